"""JSON schema and dtype patterns, checked as regexes (no model): numbers that end, exact
integer ranges, bounded numbers, strings that end at their quote, the JSON layouts.

References are independent of the library: `jsonschema` (after `json.loads`) decides what
is valid, `re.fullmatch` what the pattern accepts, `json.dumps` what each layout looks like.
The token-level side (the compiled index, sampling) is in tests/runtime/test_constrained.py.
"""

from __future__ import annotations

import json
import re
from itertools import combinations

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmprog.ir import NUMBER_END, REGEX_FLOAT, REGEX_INT, REGEX_STR
from lmprog.ops import DTYPE_NUMBER_END, DTYPE_REGEX
from lmprog_runtime.constrained.json_schema import Layout, schema_to_regex

# A bound keyword: (name, value); draft 4's boolean exclusive flags ride on minimum/maximum.
_BOUND = st.one_of(st.integers(-(10**6), 10**6), st.floats(-1e4, 1e4).map(lambda x: round(x, 1)))


@st.composite
def _integer_schemas(draw, span=10**5):
    """(schema, draft): bounds inclusive or exclusive, in draft 4's style (a boolean flag
    beside the bound) or draft 6+'s (the exclusive bound is the keyword's value)."""
    draft = draw(st.sampled_from([4, 7]))
    schema = {"type": "integer"}
    lo = draw(st.one_of(st.none(), _BOUND))
    hi = draw(st.one_of(st.none(), _BOUND.map(lambda b: b if lo is None else lo + abs(b) % span)))
    for key, value, flag in (
        ("minimum", lo, "exclusiveMinimum"),
        ("maximum", hi, "exclusiveMaximum"),
    ):
        if value is None:
            continue
        if not draw(st.booleans()):
            schema[key] = value
        elif draft == 7:
            schema[flag] = value
        else:
            schema[key], schema[flag] = value, True
    return schema, draft


def _window(schema):
    """Integers around every bound the schema names, around 0 and around int64's limits."""
    edges = [0, -(2**63), 2**63 - 1]
    edges += [int(v) for k, v in schema.items() if k != "type" and not isinstance(v, bool)]
    return sorted({v for e in edges for v in range(e - 3, e + 4)})


@given(_integer_schemas(), st.lists(st.integers(-(2**64), 2**64), max_size=20))
def test_integer_pattern_matches_exactly_the_values_the_schema_accepts(case, extra):
    """`jsonschema` is the reference; an unbounded integer means int64."""
    schema, draft = case
    validator = (jsonschema.Draft4Validator if draft == 4 else jsonschema.Draft7Validator)(schema)
    values = _window(schema) + extra
    try:
        regex = schema_to_regex(json.dumps(schema))
    except ValueError as error:
        assert "empty" in str(error)
        assert not any(validator.is_valid(v) for v in values)
        return
    for v in values:
        expected = validator.is_valid(v) and -(2**63) <= v < 2**63
        assert bool(re.fullmatch(regex, str(v))) == expected, (schema, v, regex)
    assert not re.fullmatch(regex, "-0") and not re.fullmatch(regex, "007")


@pytest.mark.parametrize("layout", list(Layout))
def test_schema_regex_layouts_match_json_dumps(layout):
    """Bounded integers inside objects and arrays; the layout's whitespace is json.dumps'."""
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 120},
            "xs": {"type": "array", "items": {"type": ["integer", "null"], "maximum": 3}},
            "f": {"type": "number"},
        },
        "required": ["n", "xs", "f"],
    }
    regex = schema_to_regex(json.dumps(schema), layout)
    separators = (",", ":") if layout is Layout.COMPACT else (", ", ": ")
    for n in range(-8, 124):
        for xs in ([], [3, None], [4], [-7, 0]):
            doc = {"n": n, "xs": xs, "f": 2.5e-3 if n % 2 else -17}
            text = json.dumps(doc, separators=separators)
            assert bool(re.fullmatch(regex, text)) == jsonschema.Draft7Validator(schema).is_valid(
                doc
            ), text
    assert not re.fullmatch(regex, '{"n":1,"xs":[],"f":1' + "0" * 17 + "}")  # float64 digits
    pretty = '{\n"n" : 1,\n"xs": [ 2],"f":1 }'
    assert bool(re.fullmatch(regex, pretty)) == (layout is Layout.OPTIONAL)
    assert not re.fullmatch(regex, pretty.replace(" :", "  :"))  # at most one space


@pytest.mark.parametrize("layout", [Layout.COMPACT, Layout.SPACED])
@pytest.mark.parametrize("required", [r for n in range(5) for r in combinations("abcd", n)])
def test_optional_members_are_laid_out_as_json_dumps(layout, required):
    """Every object of four members, each required or not, with any of its optional ones:
    an optional member's comma ends its group (SPACED wrote `{"b": true,"c": true}`), and
    a required member's comma before an optional one opens the group (`{"a": true,"d"`)."""
    booleans = {name: {"type": "boolean"} for name in "abcd"}
    schema = {"type": "object", "properties": booleans, "required": list(required)}
    regex = schema_to_regex(json.dumps(schema), layout)
    separators = (",", ":") if layout is Layout.COMPACT else (", ", ": ")
    optional = [name for name in "abcd" if name not in required]
    for n in range(len(optional) + 1):
        for present in combinations(optional, n):
            names = [name for name in "abcd" if name in required or name in present]
            doc = json.dumps(dict.fromkeys(names, True), separators=separators)
            assert re.fullmatch(regex, doc), doc


@pytest.mark.parametrize("max_length", [None, 0, 1, 3])
@given(
    st.lists(
        st.sampled_from(["a", " ", "é", "\u2603", "\\n", '\\"', "\\\\", "\\", '"']), max_size=5
    )
)
def test_strings_end_at_the_closing_quote_and_never_inside_an_escape(max_length, pieces):
    """`json.loads` + `jsonschema` are the reference: a cut by `maxLength` counts whole
    characters, an escape is one character, and a dangling backslash is never complete."""
    schema = (
        {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    )
    regex = schema_to_regex(json.dumps(schema))
    text = '"' + "".join(pieces) + '"'
    try:
        expected = jsonschema.Draft7Validator(schema).is_valid(json.loads(text))
    except ValueError:
        expected = False
    assert bool(re.fullmatch(regex, text)) == expected, (regex, text)


@given(
    st.sampled_from(["minimum", "exclusiveMinimum", None]),
    st.sampled_from(["maximum", "exclusiveMaximum", None]),
    st.floats(-60, 60).map(lambda x: round(x, 1)),
    st.floats(0, 80).map(lambda x: round(x, 1)),
)
def test_bounded_numbers_stay_in_range(lower, upper, lo, width):
    """Every decimal the pattern matches validates (`jsonschema`); every integer that
    validates matches; `n.5` matches wherever all of [n, n + 1] is inside the bounds."""
    schema = {"type": "number"}
    schema.update({lower: lo} if lower else {})
    schema.update({upper: lo + width} if upper else {})
    try:
        regex = schema_to_regex(json.dumps(schema))
    except ValueError as error:
        assert "minimum" in str(error).lower() or "maximum" in str(error).lower()
        return
    validator = jsonschema.Draft7Validator(schema)
    for n in range(int(lo) - 3, int(lo + width) + 4):
        for text in (str(n), f"{n}.5", f"{n}.0", f"{n}.999", f"-0.{abs(n)}", f"{n}e1"):
            if re.fullmatch(regex, text):
                assert validator.is_valid(json.loads(text)), (schema, text)
        assert bool(re.fullmatch(regex, str(n))) == validator.is_valid(n), (schema, n)
        inside = validator.is_valid(n) and validator.is_valid(n + 1)
        if inside and n >= 0:
            assert re.fullmatch(regex, f"{n}.5"), (schema, n)


@pytest.mark.parametrize(
    ("int_regex", "float_regex", "ends"),
    [
        (REGEX_INT, REGEX_FLOAT, NUMBER_END),  # lp.REGEX_*: SGLang's whitespace end
        (DTYPE_REGEX[int], DTYPE_REGEX[float], DTYPE_NUMBER_END),  # gen(dtype=...)
    ],
)
@given(st.integers(-(10**20), 10**20), st.sampled_from(["", " ", "\n", ".", ",", "  ", ".,", "x"]))
def test_int_and_float_patterns_end(int_regex, float_regex, ends, value, tail):
    """What fits the machine type matches, with at most one end character after it;
    longer numbers never match."""
    ok_end = tail == "" or (len(tail) == 1 and tail in ends)
    text = str(value) + tail
    assert bool(re.fullmatch(int_regex, text)) == (len(str(abs(value))) <= 18 and ok_end), text
    if re.fullmatch(int_regex, text):
        assert int(text.rstrip(ends)) == value
    decimal = f"{value / 7:.6f}{tail}"
    fits = abs(value / 7) < 1e16 and ok_end
    assert bool(re.fullmatch(float_regex, decimal)) == fits, decimal
    if re.fullmatch(float_regex, decimal):
        assert float(decimal.rstrip(ends)) == float(f"{value / 7:.6f}")
    assert not re.fullmatch(float_regex, "1." + "0" * 17) and not re.fullmatch(float_regex, "1e+")


@given(st.text(max_size=6))
def test_dtype_str_pattern_is_a_json_string_literal(value):
    text = json.dumps(value, ensure_ascii=False)
    printable = not any(ord(c) < 0x20 and c not in "\b\f\n\r\t" for c in value)
    if printable:
        assert re.fullmatch(REGEX_STR, text) and json.loads(text) == value
    assert not re.fullmatch(REGEX_STR, text[:-1] + '\\"')  # a quote escaped is not an end


def test_bounds_apply_through_refs_and_oddly_named_properties():
    """A property named like a keyword and a `$ref` into `$defs` get their bounds too."""
    schema = {
        "type": "object",
        "properties": {
            "default": {"type": "integer", "minimum": 0, "maximum": 5},
            "enum": {"$ref": "#/$defs/small"},
        },
        "required": ["default", "enum"],
        "$defs": {"small": {"type": "integer", "minimum": 1, "exclusiveMaximum": 4}},
    }
    regex = schema_to_regex(json.dumps(schema))
    for a in range(-2, 8):
        for b in range(-2, 8):
            doc = {"default": a, "enum": b}
            expected = jsonschema.Draft202012Validator(schema).is_valid(doc)
            assert bool(re.fullmatch(regex, json.dumps(doc))) == expected, doc


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10}, "multipleOf"),
        ({"type": "integer", "not": {"const": 5}, "minimum": 0, "maximum": 9}, "not"),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
        ({"type": ["integer", "null"], "multipleOf": 2}, "multipleOf"),
        (
            {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}},
            "multipleOf",
        ),
    ],
)
def test_keywords_a_number_pattern_cannot_enforce_are_refused(schema, keyword):
    """The number's own pattern replaced its subschema before the check, so these were
    accepted: `multipleOf: 3` on 0..10 compiled to `(10|[0-9])`, and 1 was written."""
    with pytest.raises(ValueError, match=f"unsupported.*{keyword}"):
        schema_to_regex(json.dumps(schema))


def _chain(levels: int) -> dict:
    """An object of objects `levels` deep, each level a `$defs` entry (models in models)."""
    schema: dict = {"$defs": {}, "type": "object", "properties": {"l1": {"$ref": "#/$defs/L1"}}}
    schema["required"] = ["l1"]
    for i in range(1, levels + 1):
        inner = {"$ref": f"#/$defs/L{i + 1}"} if i < levels else {"type": "boolean"}
        schema["$defs"][f"L{i}"] = {
            "type": "object",
            "properties": {f"l{i + 1}": inner, "n": {"type": "integer"}},
            "required": [f"l{i + 1}", "n"],
        }
    return schema


@pytest.mark.parametrize("levels", [4, 5, 6, 20, 64])
def test_models_nested_deep_keep_every_property(levels):
    """outlines-core's default max_recursion_depth (3) left out, silently, every property
    past the fifth $ref: required fields went missing, and where the dropped one was last
    the regex forced a trailing comma (`{"code": "fr", }`)."""
    value: object = True
    for i in range(levels + 1, 1, -1):
        value = {f"l{i}": value, "n": i}
    doc = {"l1": value}
    schema = _chain(levels)
    jsonschema.validate(doc, schema)
    regex = schema_to_regex(json.dumps(schema), Layout.SPACED)
    assert re.fullmatch(regex, json.dumps(doc))


def test_refs_past_the_depth_limit_and_wide_dags_are_refused_at_once():
    with pytest.raises(ValueError, match="more than 64 \\$refs nested"):
        schema_to_regex(json.dumps(_chain(65)))
    # Each level's two definitions refer to both of the next level's: the recursion check
    # walked all 2^40 paths.
    dag: dict = {"$defs": {"A40": {"type": "boolean"}, "B40": {"type": "null"}}}
    dag["$ref"] = "#/$defs/A1"
    for i in range(1, 40):
        refs = {"x": {"$ref": f"#/$defs/A{i + 1}"}, "y": {"$ref": f"#/$defs/B{i + 1}"}}
        for name in "AB":
            dag["$defs"][f"{name}{i}"] = {"type": "object", "properties": refs}
    with pytest.raises(ValueError, match="its regex would be about"):
        schema_to_regex(json.dumps(dag))


def test_maps_of_maps_are_estimated_as_written_twice():
    """A `dict[str, Model]` chain: outlines-core writes a map's value pattern twice, each
    with its key's, which the estimate counted once (20 levels ran out of memory once the
    $ref depth limit no longer stopped at 3). 8 levels (about 30,000 characters) translate."""
    schema: dict = {"$defs": {"M15": {"type": "boolean"}}, "$ref": "#/$defs/M1"}
    for i in range(1, 15):
        schema["$defs"][f"M{i}"] = {
            "type": "object",
            "additionalProperties": {"$ref": f"#/$defs/M{i + 1}"},
        }
    with pytest.raises(ValueError, match="its regex would be about"):
        schema_to_regex(json.dumps(schema))
    schema["$defs"]["M9"] = {"type": "boolean"}
    assert 20_000 < len(schema_to_regex(json.dumps(schema))) < 100_000


@pytest.mark.parametrize("seed", range(6))
def test_a_long_chain_through_a_name_walked_before_is_refused(seed):
    """The depth check stored each name's depth and skipped it on a longer path (the set
    of refs walks in hash order): a 100-long chain got through, its properties dropped."""
    import random

    schema = _chain(100)
    names = [f"L{i}" for i in random.Random(seed).sample(range(1, 101), 3)]
    schema["properties"].update({n.lower(): {"$ref": f"#/$defs/{n}"} for n in names})
    with pytest.raises(ValueError, match="more than 64 \\$refs nested"):
        schema_to_regex(json.dumps(schema))
