"""JSON schemas made ready for outlines-core's translation (`schema_prepare.py`): what would
translate into documents that do not validate is refused with ValueError, and what is
rewritten only narrows the schema. Checked against `re.search` of the original pattern,
`json.dumps` (no escapes needed) and jsonschema's own format checker."""

from __future__ import annotations

import datetime
import json
import re
import sys
from typing import Annotated
from urllib.parse import urlparse

import jsonschema
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.constrained.json_schema import schema_to_regex
from lmprog_runtime.constrained.schema_prepare import prepared
from lmprog_runtime.constrained.string_patterns import FORMATS, json_safe_pattern

OBJECT_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
OBJECT_B = {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}

REFUSED = [  # (schema, message)
    ({"allOf": [OBJECT_A, OBJECT_B]}, "allOf"),  # (once: two objects one after the other)
    ({"allOf": [OBJECT_A], "type": "object"}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),  # (once: as anyOf)
    ({"type": "object", "properties": {'q"k': {"type": "boolean"}}}, "escapes"),
    ({"type": "object", "properties": {"a\\b": {"type": "boolean"}}}, "escapes"),
    ({**OBJECT_A, "required": ["a", "b"]}, "required"),  # (once: b dropped)
    ({"type": "object", "properties": {"l": {"items": {"$ref": "#"}}}}, "recursive"),
    (
        {
            "$ref": "#/$defs/N",
            "$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}}},
        },
        "recursive",
    ),
    ({"type": "string", "pattern": 'a"b'}, "pattern"),
    ({"type": "string", "pattern": "\\S+"}, "pattern"),
    ({"type": "string", "pattern": "a\\\\b"}, "pattern"),
    ({"type": "string", "format": "date", "pattern": "[0-9]+"}, "format"),
    # (once: an empty list of alternatives let the value out, `{"a": }`, or came out empty)
    ({**OBJECT_A, "properties": {"a": {"enum": []}}}, "'enum' is an empty list"),
    ({"anyOf": []}, "'anyOf' is an empty list"),
    ({"oneOf": [], "discriminator": {"propertyName": "k"}}, "'oneOf' is an empty list"),
    ({"type": []}, "'type' is an empty list"),
    # Escapes and ranges that let a quote, a backslash or a control character in raw.
    ({"type": "string", "pattern": "^a\\nb$"}, "could let a quote"),
    ({"type": "string", "pattern": "^\\042$"}, "could let a quote"),
    ({"type": "string", "pattern": "^\\N{QUOTATION MARK}x$"}, "could let a quote"),
    ({"type": "string", "pattern": "^[\\b]$"}, "could let a quote"),
    ({"type": "string", "pattern": '^["]$'}, "holds"),
    # Constraints the translation dropped for the keyword beside them (outputs broke them).
    ({"type": "string", "minLength": 3, "enum": ["a", "bcd"]}, "next to 'enum'"),
    ({"type": "string", "pattern": "^[A-Z]{3}$", "maxLength": 2}, "values are 3 characters"),
    ({"type": "string", "pattern": "^[A-Z]+$", "maxLength": 9}, "values are 1 or more"),
    ({"type": "string", "pattern": "^[A-Z]{3}$", "minLength": 4}, "next to a 'pattern'"),
    ({"type": "string", "format": "date", "maxLength": 3}, "next to a 'pattern' or 'format'"),
    ({"type": "string", "format": "email", "maxLength": 99}, "values are 6 to 185"),
    # (read otherwise by Python's re and pydantic's regex: combining marks, U+00A0)
    ({"type": "string", "pattern": "^[^\\w]$"}, "'\\\\w' in a negated class"),
    ({"type": "string", "pattern": "[^a\\s]"}, "'\\\\s' in a negated class"),
    ({"type": "string", "format": "uri", "maxLength": 229}, "'maxLength' of 230 or more"),
    ({"type": "string", "pattern": "^a$", "maxLength": True}, "non-negative integer"),
    ({"type": "string", "pattern": "^a$", "minLength": -1}, "non-negative integer"),
    ({"type": "string", "pattern": "^a$", "maxLength": 1.5}, "non-negative integer"),
    ({"type": "string", "pattern": "^(a$", "maxLength": 3}, "cannot read"),
    ({"type": "string", "enum": ["a"], "pattern": "^b"}, "next to 'enum'"),
    ({"$ref": "#/$defs/S", "maxLength": 2, "$defs": {"S": {"type": "string"}}}, "next to '\\$ref'"),
    ({"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]}, "next to 'anyOf'"),
    ({"type": "integer", "const": "x"}, "'const' 'x' is no integer"),
    ({"type": "string", "enum": [1, 2]}, "no 'enum' value is a string"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "minItems": 3}, "prefixItems"),
    ({**OBJECT_A, "dependencies": {"a": ["b"]}}, "dependencies"),  # (draft 7: dropped)
    ({"type": "integer", "maximum": 1e400}, "not finite"),  # (an OverflowError)
]


@pytest.mark.parametrize(("schema", "message"), REFUSED)
def test_what_would_not_validate_is_refused(schema, message):
    with pytest.raises(ValueError, match=message):
        schema_to_regex(json.dumps(schema))


def test_a_refusal_says_where_in_the_schema():
    """A model of many fields, in a model: the refusal named the keyword, not the field."""

    class Inner(pydantic.BaseModel):
        name: str
        slug: str = pydantic.Field(pattern="^[a-z]+$", max_length=5)

    class Outer(pydantic.BaseModel):
        title: str
        inner: Inner

    with pytest.raises(ValueError, match=r"'maxLength'.* \(at /\$defs/Inner/properties/slug\)$"):
        schema_to_regex(json.dumps(Outer.model_json_schema()))
    with pytest.raises(ValueError, match=r"\(at /properties/a/properties/b\)$"):
        nested = {"properties": {"b": {"type": "string", "format": "email", "pattern": "x"}}}
        schema_to_regex(json.dumps({"type": "object", "properties": {"a": nested}}))


@pytest.mark.parametrize(
    "schema",
    [
        # pydantic's wrapper of a reference with a description
        {
            "type": "object",
            "properties": {"x": {"allOf": [{"$ref": "#/$defs/E"}], "description": "d"}},
            "required": ["x"],
            "$defs": {"E": {"enum": ["p", "q"]}},
        },
        # pydantic's tagged union: its branches cannot both match
        {
            "oneOf": [
                {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]},
            ],
            "discriminator": {"propertyName": "k"},
        },
        # a reference used twice is no recursion
        {
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/T"}, "b": {"$ref": "#/$defs/T"}},
            "$defs": {"T": {"type": "boolean"}},
        },
        # identifiers and annotations beside the keywords enforced alone (`$schema` at the
        # top, pydantic's `deprecated`)
        {"$schema": "https://json-schema.org/draft/2020-12/schema", "anyOf": [OBJECT_A]},
        {"$ref": "#/$defs/A", "$defs": {"A": OBJECT_A}, "deprecated": True},
        {"$id": "urn:colour", "type": "string", "enum": ["red"], "readOnly": True},
        {"enum": ["red", "blue"], "x-order": [2, 1]},  # (an extension keyword)
        # an empty list that is not a schema's alternatives: an extension keyword's value
        {**OBJECT_A, "x-meta": {"enum": []}},
    ],
)
def test_what_can_be_enforced_still_translates(schema):
    assert schema_to_regex(json.dumps(schema))


PATTERNS = [
    *("^x.{2}$", "a|b", "[^x]{1,3}", "^[A-Z]{2}-\\d{2}$", "[a-c]\\s[^]a]", "(yes|no)!"),
    *("^[ -~]{3}$", "[!-#]{2}", "[\\]-a]", "[-x]+"),  # (ranges that held a quote or a backslash)
    *("^\\w+@\\w+\\.com$", "[\\w.-]{2,4}", "\\w[^,]"),
]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_narrowed_pattern_allows_only_strings_the_original_finds_and_json_holds_raw(
    pattern, data
):
    text = data.draw(st.from_regex(json_safe_pattern(pattern), fullmatch=True))
    assert re.search(pattern, text), (pattern, text)
    assert json.dumps(text, ensure_ascii=False) == f'"{text}"'  # (nothing to escape)


@pytest.mark.parametrize("pattern", ["^\\w$", "^[\\w.]$"])
def test_word_characters_are_the_ones_pydantic_takes_too(pattern):
    """Every character: `\\w` in a schema's pattern takes one where both Python's `re` and
    pydantic (Rust's regex) do. It took what `re` takes, so pydantic refused `¼` or `₂`."""
    narrowed = re.compile(json_safe_pattern(pattern))
    adapter = pydantic.TypeAdapter(Annotated[str, pydantic.StringConstraints(pattern=pattern)])
    python = re.compile(pattern)
    for code in range(sys.maxunicode + 1):
        char = chr(code)
        if python.fullmatch(char) is None:
            continue
        try:
            adapter.validate_python(char)
            taken = True
        except pydantic.ValidationError:
            taken = False
        assert (narrowed.fullmatch(char) is not None) == taken, hex(code)


@settings(max_examples=80, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("form", sorted(FORMATS))
def test_the_format_patterns_give_valid_values_json_holds_raw(form, data):
    text = data.draw(st.from_regex(FORMATS[form], fullmatch=True))
    assert text.isascii() and json.dumps(text) == f'"{text}"'
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    assert checker.conforms(text, form), text
    if form == "date":
        datetime.date.fromisoformat(text)  # (a day every month has)
    if form == "uri":
        assert urlparse(text).scheme in ("http", "https")
        pydantic.TypeAdapter(pydantic.HttpUrl).validate_python(text)


URLS = [  # (a URL, whether pydantic's HttpUrl takes it)
    *[("http://a", True), ("https://example.com:8080/a/b?c=d&e=%20#f", True)],
    *[("http://a:65535", True), ("http://a-b.c-d/'()*", True), ("http://x.y.z.com", True)],
    *[("http://a:65536", False), ("http://a:99999", False), ("ftp://a", False)],
    *[("http://a.1", False), ("http://1.2.3.999", False), ("http://a.0x", False)],
    *[("http://xn--a", False), ("http://xn--abc.com", False), ("http://a.XN--b", False)],
]


@pytest.mark.parametrize(("url", "taken"), URLS)
def test_the_uri_patterns_take_only_urls_pydantic_takes(url, taken):
    """outlines-core's `uri`, and the first one here, let out a port past 65535, a host
    that reads as a bad IPv4 address (`a.1`) and `ftp://`, which HttpUrl refuses."""
    adapter = pydantic.TypeAdapter(pydantic.HttpUrl)
    if not taken:
        with pytest.raises(pydantic.ValidationError):
            adapter.validate_python(url)
    bounded = prepared({"type": "string", "format": "uri", "maxLength": 2083})["pattern"]
    for pattern in (FORMATS["uri"], bounded):
        assert bool(re.fullmatch(pattern, url)) == taken, (pattern, url)
    adapter.validate_python(url) if taken else None


EMAILS = [  # (an address, whether pydantic's EmailStr takes it)
    *[("a@x.io", True), ("john.doe+tag@mail.example.com", True), ("a_b-c@x-y.z.org", True)],
    *[("a..b@x.com", False), (".a@x.com", False), ("a.@x.com", False), ("a@-x.com", False)],
    *[("a@x-.com", False), ("a@x..com", False), ("a@" + "x" * 64 + ".com", False)],
    *[("a@ab--cd.com", False), ("a@xn--a.com", False), ("a@a-b-c.io", True)],
]


@pytest.mark.parametrize(("address", "taken"), EMAILS)
def test_the_email_pattern_takes_only_addresses_pydantic_takes(address, taken):
    """The pattern here before let through a double dot, a dot at either end of the local
    part, a hyphen at either end of a label and labels past 63 characters."""
    pytest.importorskip("email_validator")
    adapter = pydantic.TypeAdapter(pydantic.EmailStr)
    if taken:
        adapter.validate_python(address)
    else:
        with pytest.raises(pydantic.ValidationError):
            adapter.validate_python(address)
    assert bool(re.fullmatch(FORMATS["email"], address)) == taken


@settings(max_examples=1000, deadline=None)
@given(address=st.from_regex(FORMATS["email"], fullmatch=True))
def test_every_address_of_the_email_pattern_is_one_pydantic_takes(address):
    pytest.importorskip("email_validator")
    if address.rsplit(".", 1)[1].lower() in (
        "arpa",
        "invalid",
        "local",
        "localhost",
        "onion",
        "test",
    ):
        return  # (special-use names it refuses: not left out, see string_patterns.py)
    pydantic.TypeAdapter(pydantic.EmailStr).validate_python(address)


class Links(pydantic.BaseModel):
    home: pydantic.HttpUrl  # (a `maxLength` of 2083 next to its `format`)
    other: pydantic.AnyUrl
    code: str = pydantic.Field(pattern="^[A-Z]{3}$", min_length=3, max_length=3)
    day: datetime.date = pydantic.Field(json_schema_extra={"maxLength": 10})


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_lengths_a_pattern_keeps_are_dropped_and_a_url_is_bounded_to_its_max(data):
    """A `minLength` / `maxLength` next to a `pattern` or `format` was refused, and with it
    every pydantic model with an HttpUrl; one that every value of the pattern fits now
    goes, and a `uri`'s pattern is bounded to fit. Checked against pydantic and
    jsonschema."""
    schema = Links.model_json_schema()
    assert schema["properties"]["home"]["maxLength"] == 2083
    regex = schema_to_regex(json.dumps(schema))
    doc = data.draw(st.from_regex(regex, fullmatch=True))
    links = Links.model_validate_json(doc)
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    jsonschema.validate(json.loads(doc), schema, format_checker=checker)
    assert len(str(links.home)) <= 2083


def _nested(levels: int) -> str:
    text = '{"type": "integer"}'
    for _ in range(levels):
        text = f'{{"type": "object", "properties": {{"k": {text}}}, "required": ["k"]}}'
    return text


def test_nesting_past_what_outlines_core_reads_is_refused_by_its_depth():
    """outlines-core reads JSON 127 objects and lists deep (a level of properties takes
    two); past that it said "Expected a valid JSON string.", and past Python's parser's
    limit the RecursionError escaped as itself."""
    assert schema_to_regex(_nested(63))  # 127 deep
    with pytest.raises(ValueError, match="nest more than 127 deep"):
        schema_to_regex(_nested(64))
    with pytest.raises(ValueError, match="nest over a thousand deep"):
        schema_to_regex(_nested(2000))
    # (and where a request's parameters and a program's gen read it first)
    from lmprog_runtime.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="over a thousand deep"):
        SamplingParams.from_dict({"json_schema": _nested(2000)})
    import lmprog as lp

    @lp.function
    def deep(s):
        s += "x" + lp.gen("a", json_schema=_nested(2000))

    with pytest.raises(ValueError, match="over a thousand deep"):
        deep.trace()


ANY_VALUE_DOCS = [  # (in outlines-core's layout) -> whether {"a": <any value>} holds
    ('{"a": true}', True),
    ('{"a": null}', True),
    ('{"a": 1.5}', True),
    ('{"a": "x"}', True),
    ('{"a": [1, {"b": "c"}]}', True),
    ('{"a": {"q": false}}', True),
    ("[929973200022]", False),
    ("null", False),
    ('"x"', False),
]


@pytest.mark.parametrize(
    "any_value",
    [{}, True, {"description": "anything"}, {"title": "A", "$comment": "no type"}],
)
def test_a_property_of_any_value_takes_every_value_and_nothing_else(any_value):
    """outlines-core writes a schema of any value as bare alternatives: as a property the
    regex read `{"a": true` OR `null` OR ..., matching `[929973200022]` and refusing
    `{"a": true}` (the tiny model wrote an array for an object schema); a bare `true` there
    was refused. Checked against jsonschema."""
    schema = {"type": "object", "properties": {"a": any_value}, "required": ["a"]}
    regex = schema_to_regex(json.dumps(schema))
    for doc, valid in ANY_VALUE_DOCS:
        assert bool(re.fullmatch(regex, doc)) == valid, doc
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(doc)) == valid, doc


def _json_values(depth: int) -> st.SearchStrategy:
    """JSON values with arrays and objects nested `depth` deep at most."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**6), 10**6),
        st.floats(-1e6, 1e6, allow_nan=False).map(lambda x: round(x, 3)),
        st.text('ab é"\\\n', max_size=4),
    )
    if depth == 0:
        return scalars
    inner = _json_values(depth - 1)
    keys = st.text("kq ", min_size=1, max_size=3)
    return st.one_of(scalars, st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=3))


OPEN_SCHEMAS = [  # (schema, how deep a member may nest, where the regex was, a document)
    ({}, 2, 13_898, lambda v: v),
    ({"type": "object", "properties": {"a": {}}, "required": ["a"]}, 2, 13_032, lambda v: {"a": v}),
    ({"type": "object"}, 1, 6_471, lambda v: {"a": v}),
    ({"type": "object", "additionalProperties": True}, 1, 6_471, lambda v: {"a": v}),
    ({"type": "array"}, 1, 6_421, lambda v: [v]),
    ({"type": "array", "items": {}}, 1, 26_059, lambda v: [v, v]),
    ({"type": "array", "items": {"type": "object"}}, 0, 0, lambda v: [{"k": v}]),
    # (spelled otherwise: the members one level less deep all the same)
    ({"type": "object", "additionalProperties": {}}, 1, 6_677, lambda v: {"a": v}),
    ({"type": ["object", "null"]}, 1, 6_486, lambda v: {"a": v}),
    ({"type": ["array", "null"]}, 1, 0, lambda v: [v]),
]


@pytest.mark.parametrize(("schema", "depth", "was", "document"), OPEN_SCHEMAS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_values_of_any_type_nest_a_few_levels_in_a_small_regex(schema, depth, was, document, data):
    """A value of any type, an object or array whose members are not given: scalars, or
    arrays and objects nested two deep (a document's own count; one less in an array's
    items), in a regex a few thousand characters long. outlines-core's own, three deep,
    took seconds to compile, and an array of any values over 60 s (refused). What the
    regex takes validates."""
    regex = schema_to_regex(json.dumps(schema))
    assert len(regex) < 4_000 and (was == 0 or len(regex) < was / 3)
    member = data.draw(_json_values(depth))
    value = document(member)
    doc = json.dumps(value, ensure_ascii=False)
    assert re.fullmatch(regex, doc), doc
    assert jsonschema.Draft202012Validator(schema).is_valid(value)
    assert not re.fullmatch(regex, json.dumps(document([[[[]]]])))  # (past the depth)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "enum": [{"a": 1}, {}]},
        {"type": "array", "enum": [[1, 2]]},
        {"type": "object", "const": {"a": 1}},
        {"type": "array", "const": [1]},
    ],
)
def test_an_object_or_array_of_listed_values_is_no_open_one(schema):
    """Its values are the listed ones: given no members of any value (which, next to
    `enum`, refused it, naming a keyword it did not have)."""
    regex = schema_to_regex(json.dumps(schema))
    values = schema.get("enum", [schema.get("const")])
    assert all(re.fullmatch(regex, json.dumps(v)) for v in values)
    assert not re.fullmatch(regex, json.dumps({"b": 2} if schema["type"] == "object" else [3]))


def test_true_and_false_as_the_whole_schema():
    regex = schema_to_regex("true")  # (outlines-core refused it)
    assert all(re.fullmatch(regex, doc) for doc in ("1", '"x"', "[null]", '{"k": {}}'))
    with pytest.raises(ValueError, match="json_schema false accepts no document"):
        schema_to_regex("false")


def test_an_enum_is_narrowed_to_the_values_of_its_type():
    regex = schema_to_regex(json.dumps({"type": "string", "enum": ["a", 1, "b"]}))
    assert [bool(re.fullmatch(regex, doc)) for doc in ('"a"', "1", '"b"')] == [True, False, True]


def test_a_regex_too_large_to_build_is_refused_before_it_is_built():
    """Each level of arrays doubles the items' pattern: 22 levels in 568 characters took
    every GiB there was; 10 levels (861k characters) still translate."""
    schema: dict = {"type": "integer"}
    for depth in range(1, 23):
        schema = {"type": "array", "items": schema}
        if depth == 10:
            assert len(schema_to_regex(json.dumps(schema))) > 800_000
    with pytest.raises(ValueError, match="its regex would be about"):
        schema_to_regex(json.dumps(schema))
