"""Single JSON-schema keywords, each at its exact boundary: a number's `const`, the digit
counts (outlines-core's `minDigits*` / `maxDigits*`, `maxDigits`), `prefixItems` against
the item counts, a bounded `uri`, and the object keywords no pattern enforces (refused).

References: `jsonschema` for standard keywords, a count of each part's digits for the
digit keywords (jsonschema does not know them), `portable_regex.width` for a pattern's
longest match; `re.fullmatch` says what the translated pattern accepts."""

from __future__ import annotations

import itertools
import json
import re

import jsonschema
import pytest

from lmprog_runtime.constrained.json_schema import schema_to_regex
from lmprog_runtime.constrained.portable_regex import width
from lmprog_runtime.constrained.string_patterns import json_safe_pattern, lengths_in_pattern


@pytest.mark.parametrize(
    "schema", [{"type": "integer", "const": 5}, {"type": "number", "const": 2.5}]
)
def test_a_numbers_const_is_its_only_value(schema):
    regex = schema_to_regex(json.dumps(schema))
    for value in ["5", "2.5", "6", "0", "-5", "2.0", "17"]:
        valid = jsonschema.Draft7Validator(schema).is_valid(json.loads(value))
        assert bool(re.fullmatch(regex, value)) == valid, (schema, value, regex)


_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?(?:[eE][+-]?([0-9]+))?")


def _digits_in_bounds(text: str, bounds: dict[str, tuple[int, int]]) -> bool:
    match = _NUMBER.fullmatch(text)
    if match is None:
        return False
    parts = dict(zip(("Integer", "Fraction", "Exponent"), match.groups()))
    return all(
        parts[part] is None or low <= len(parts[part]) <= high
        for part, (low, high) in bounds.items()
    )


@pytest.mark.parametrize(
    "bounds",
    [
        {"Integer": (1, 2), "Fraction": (1, 2), "Exponent": (1, 1)},
        {"Integer": (2, 3), "Fraction": (2, 3), "Exponent": (1, 2)},
    ],
)
def test_digit_keywords_bound_each_part_exactly(bounds):
    schema = {"type": "number"}
    for part, (low, high) in bounds.items():
        schema[f"minDigits{part}"], schema[f"maxDigits{part}"] = low, high
    regex = schema_to_regex(json.dumps(schema))
    wholes = ["0", "5", "10", "99", "100", "999", "1000"]
    fractions = ["", ".5", ".25", ".125", ".1250"]
    exponents = ["", "e5", "e55", "E+555"]
    for text in map("".join, itertools.product(wholes, fractions, exponents)):
        assert bool(re.fullmatch(regex, text)) == _digits_in_bounds(text, bounds), text


@pytest.mark.parametrize("digits", [1, 2, 3])
def test_max_digits_allows_exactly_that_many_digits(digits):
    regex = schema_to_regex(json.dumps({"type": "integer", "maxDigits": digits}))
    top = 10**digits - 1
    for value in [top, -top, top + 1, -(top + 1), 0]:
        assert bool(re.fullmatch(regex, str(value))) == (len(str(abs(value))) <= digits), value


_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}


@pytest.mark.parametrize(
    "extra",
    [
        {"maxProperties": 1},
        {"minProperties": 2},
        {"propertyNames": {"maxLength": 1}},
        {"patternProperties": {"^x": {"type": "string"}}},
        {"dependentRequired": {"a": ["b"]}},
    ],
)
def test_object_keywords_no_pattern_enforces_are_refused(extra):
    with pytest.raises(ValueError, match=next(iter(extra))):
        schema_to_regex(json.dumps({**_OBJECT, **extra}))


@pytest.mark.parametrize("counts", [{"maxItems": 1}, {"minItems": 3}, {"maxItems": 0}])
def test_prefix_items_the_item_counts_exclude_are_refused(counts):
    """(the translation writes exactly the prefix items: each output broke the count)"""
    schema = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], **counts}
    with pytest.raises(ValueError, match="prefixItems"):
        schema_to_regex(json.dumps(schema))


@pytest.mark.parametrize("most", [230, 231, 260, 358, 2083])
def test_a_bounded_uris_pattern_is_never_longer_than_max_length(most):
    node = lengths_in_pattern({"type": "string", "format": "uri", "maxLength": most})
    low, high = width(json_safe_pattern(node["pattern"]))
    assert high is not None and high <= most, (most, high)
