"""Constrained decoding (regex / JSON schema) on the tiny random-weight model.

References are independent of the library: `re.fullmatch` for regexes, `jsonschema.validate`
(after `json.loads`) for schemas, and each request run alone for batch invariance. Patterns
are bounded (bounded repeats, maxLength, maxItems, enums, digit limits) and max_new_tokens
covers the longest possible output, so every generation must end with a grammar stop; an
output cut short must say `"constraint": "incomplete"` and is never accepted as valid.
"""

from __future__ import annotations

import datetime
import enum
import json
import re
import threading

import jsonschema
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lmprog as lp

HYPO = settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
MANY = settings(HYPO, max_examples=250)  # the slow tier
PROMPTS = ["Hi", "Answer:", '{"name": "Alice", "age":', "The list is"]
# ---- regexes: (pattern, longest match in characters) ------------------------------------
_literal = st.text("abcxyz0189_. -", min_size=1, max_size=3).map(
    lambda s: ("".join("\\" + c if c in ".-" else c for c in s), len(s))
)
_klass = st.sampled_from(["[a-c]", "[0-9]", "[xyz]", "[a-f0-3]", "[._]"]).map(lambda c: (c, 1))


def _regex_node(children):
    repeat = st.tuples(children, st.integers(0, 3), st.integers(0, 3)).map(
        lambda t: (f"({t[0][0]}){{{t[1]},{t[1] + t[2]}}}", t[0][1] * (t[1] + t[2]))
    )
    parts = st.lists(children, min_size=2, max_size=3)
    alt = parts.map(lambda ps: ("(" + "|".join(p for p, _ in ps) + ")", max(n for _, n in ps)))
    cat = parts.map(lambda ps: ("".join(p for p, _ in ps), sum(n for _, n in ps)))
    return st.one_of(repeat, alt, cat)


REGEXES = st.recursive(st.one_of(_literal, _klass), _regex_node, max_leaves=6).filter(
    lambda p: p[1] <= 60
)
BOUNDED_NUMBER = dict(type="number", maxDigitsInteger=2, minDigitsFraction=1)
BOUNDED_NUMBER.update(maxDigitsFraction=2, minDigitsExponent=1, maxDigitsExponent=1)
# ---- JSON schemas: (schema, bound on output tokens: one token is at least one byte) ------
_leaf = st.one_of(
    st.just(({"type": "boolean"}, 5)),
    st.just(({"type": "null"}, 4)),
    st.lists(
        st.one_of(st.text("abxyz", min_size=1, max_size=4), st.integers(-5, 99)),
        min_size=1,
        max_size=3,
        unique_by=json.dumps,
    ).map(lambda v: ({"enum": v}, 8)),
    st.integers(0, 5).map(lambda k: ({"type": "string", "maxLength": k}, 2 + 4 * k)),
    st.just(({"type": "string", "pattern": "^[a-z]{1,4}$"}, 6)),
    st.just(({"type": "integer", "maxDigits": 3}, 4)),
    st.just(({"type": "integer"}, 20)),  # int64: 19 digits and a sign
    st.just(({"type": "number", "minimum": -5, "exclusiveMaximum": 5.5}, 20)),
    st.tuples(st.integers(-300, 300), st.integers(0, 50)).map(
        lambda t: ({"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}, 4)
    ),
    st.just((BOUNDED_NUMBER, 10)),
)


def _schema_node(children):
    array = st.tuples(children, st.integers(0, 1), st.integers(1, 3)).map(
        lambda t: (
            {"type": "array", "items": t[0][0], "minItems": t[1], "maxItems": t[2]},
            4 + t[2] * (t[0][1] + 3),
        )
    )
    obj = st.dictionaries(
        st.sampled_from(["a", "id", "tag", "ok"]), children, min_size=1, max_size=3
    ).flatmap(
        lambda props: st.one_of(
            st.just(sorted(props)), st.lists(st.sampled_from(sorted(props)), unique=True)
        ).map(
            lambda req: (
                {
                    "type": "object",
                    "properties": {k: s for k, (s, _) in props.items()},
                    "required": req,
                },
                4 + sum(len(k) + 8 + n for k, (_, n) in props.items()),
            )
        )
    )
    return st.one_of(array, obj)


SCHEMAS = st.recursive(_leaf, _schema_node, max_leaves=5).filter(lambda p: p[1] <= 250)


def _check_batch(engine, prompt, seed, key, pattern, max_new, valid):
    """Generate at temperature 0 and 1 in one batch; every output must be a complete match."""
    params = [
        {key: pattern, "max_new_tokens": max_new, "temperature": t, "seed": seed} for t in (0, 1)
    ]
    for out in engine.generate([prompt, prompt], params):
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "stop" and "constraint" not in reason, (out, pattern)
        assert out["output_ids"][-1] == engine._grammar_eos
        valid(out["text"])


def _regex_fullmatches(engine, case, prompt, seed):
    regex, longest = case

    def valid(text):
        assert re.fullmatch(regex, text), (regex, text)

    _check_batch(engine, prompt, seed, "regex", regex, longest + 4, valid)


def _schema_validates(engine, case, prompt, seed):
    schema, bound = case
    text = json.dumps(schema)
    check = lambda out: jsonschema.validate(json.loads(out), schema)  # noqa: E731
    _check_batch(engine, prompt, seed, "json_schema", text, bound + 8, check)


@HYPO
@given(REGEXES, st.sampled_from(PROMPTS), st.integers(0, 2**31))
def test_generated_regexes_always_fullmatch(engine, case, prompt, seed):
    _regex_fullmatches(engine, case, prompt, seed)


@HYPO
@given(SCHEMAS, st.sampled_from(PROMPTS), st.integers(0, 2**31))
def test_generated_json_schemas_always_validate(engine, case, prompt, seed):
    _schema_validates(engine, case, prompt, seed)


@pytest.mark.slow
@MANY
@given(REGEXES, st.sampled_from(PROMPTS), st.integers(0, 2**31))
def test_many_generated_regexes_always_fullmatch(engine, case, prompt, seed):
    _regex_fullmatches(engine, case, prompt, seed)


@pytest.mark.slow
@MANY
@given(SCHEMAS, st.sampled_from(PROMPTS), st.integers(0, 2**31))
def test_many_generated_json_schemas_always_validate(engine, case, prompt, seed):
    _schema_validates(engine, case, prompt, seed)


def test_mixed_batch_equals_each_request_alone(engine):
    obj = {
        "type": "object",
        "properties": {
            "k": {"enum": ["x", "y"]},
            "v": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["k", "v"],
    }
    specs = [
        {"regex": "[a-c]{1,5}(x|yz)"},
        {"regex": "(cat|dog)s?[0-9]{2}"},
        {"regex": "[0-9]{1,3}\\.[0-9]"},
        {"json_schema": json.dumps(obj)},
        {"json_schema": json.dumps({"type": "string", "maxLength": 4})},
        {"json_schema": json.dumps({"enum": ["up", "down", 7]})},
        {},
        {},
        {"ignore_eos": True},
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(len(specs))]
    params = [{**spec, "max_new_tokens": 48, "temperature": 0} for spec in specs]
    batch = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, batch):
        alone = engine.generate(prompt, p)
        assert (out["text"], out["output_ids"]) == (alone["text"], alone["output_ids"])
        if "regex" in p:
            assert re.fullmatch(p["regex"], out["text"])
        elif "json_schema" in p:
            jsonschema.validate(json.loads(out["text"]), json.loads(p["json_schema"]))


def _start(engine, prompt, params):
    """Run a request on a thread (it shares batches with the caller's); returns join()."""
    result = {}

    def work():
        try:
            result.update(engine.generate(prompt, params))
        except Exception as error:  # noqa: BLE001 - reported by the test's assertion
            result["error"] = error

    worker = threading.Thread(target=work)
    worker.start()
    return lambda: (worker.join(), result)[1]


BAD = [
    ({"regex": "(unclosed"}, "cannot compile regex"),
    ({"regex": "[z-a]"}, "cannot compile regex"),
    # No string matches: said so (outlines-core's message blamed the vocabulary's encoding).
    ({"regex": "[^\\s\\S]"}, "no text matches it"),
    ({"regex": "a[^\\s\\S]b"}, "no text matches it"),
    ({"json_schema": "{not json"}, "(?i)json.?schema"),  # BUG: bare JSONDecodeError
    # Between two integers: no `n` or `n.f` fits, so the bounds cannot be enforced.
    ({"json_schema": json.dumps({"type": "number", "minimum": 0.2, "maximum": 0.8})}, "minimum"),
    ({"json_schema": json.dumps({"maximum": 3})}, "unsupported.*maximum"),  # no type
    ({"json_schema": json.dumps({"type": "integer", "minimum": 3, "maximum": 2})}, "empty"),
    ({"json_schema": json.dumps({"type": "foo"})}, "unsupported JSON schema"),
    ({"regex": "a", "json_schema": "{}"}, "regex.*json_schema|at most one"),  # BUG: accepted
    # Rust's class syntax, which Python's re reads as literals: outputs would not fullmatch.
    ({"regex": "[[:digit:]]{2}"}, "Rust"),
    ({"regex": "[a-z&&[^b]]{3}"}, "Rust"),
]


@pytest.mark.parametrize(("bad", "message"), BAD)
def test_bad_constraint_is_refused_at_submit_while_another_request_runs(engine, bad, message):
    free = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    expected = engine.generate("Once upon a time", free)
    join = _start(engine, "Once upon a time", free)
    with pytest.raises(ValueError, match=message):
        engine.generate("Hi", {**bad, "max_new_tokens": 16})
    result = join()
    assert result.get("output_ids") == expected["output_ids"], result.get("error")
    assert result["meta_info"]["finish_reason"]["type"] == "length"
    if len(bad) == 1:  # a refused pattern is not cached
        assert next(iter(bad.items())) not in engine._grammars._entries


# outlines-core's engine (Rust) refused these or read them otherwise: `^` anywhere, `a{,3}`;
# `a{1, 3}` as a repeat, where Python's re reads text; `\\S` and `(?i)` took characters
# Python's do not (U+001C, U+212A). An anchor at an edge stays one under token healing.
PYTHON_READINGS = [r"^[0-9]{2}$", r"\A(yes|no)\Z", "a{,3}b", r"[\w-]{1,4}$", r"(?i)[a-k]{2}"]
PYTHON_READINGS += ["a{1, 3}", "$", r"^\S{1,3}", r"(?s).{1,2}"]


@pytest.mark.parametrize("regex", PYTHON_READINGS)
@pytest.mark.parametrize("healing", [False, True])
def test_patterns_mean_what_pythons_re_reads_in_them(engine, regex, healing):
    """Four samples each, from a prompt whose last token (a lone space) heals."""
    params = {"regex": regex, "max_new_tokens": 16, "token_healing": healing}
    params = [{**params, "seed": seed, "temperature": 1} for seed in range(4)]
    for out in engine.generate(["Age: "] * 4, params):
        assert ("token_healing" in out["meta_info"]) == healing
        assert "constraint" not in out["meta_info"]["finish_reason"], (regex, out)
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


@pytest.mark.parametrize(
    "regex", [r"x(a|^b)", r"a$\n", r"a\Ab", r"(^a)*", r"\bword", r"a*+", r"(?>ab)"]
)
def test_anchors_away_from_the_edges_and_possessive_repeats_are_refused(engine, regex):
    # (3.10's re has no possessive repeat or atomic group: it refuses them itself)
    refused = "only at the start|not supported|not a regular|Python's re refuses it"
    with pytest.raises(ValueError, match=refused):
        engine.generate("Hi", {"regex": regex, "max_new_tokens": 4})


def test_any_unicode_character_is_producible(engine):
    """Byte-level BPE covers all 256 bytes, so no regex is unproducible for want of a
    character; only an empty language (`[^\\s\\S]` above) is refused as incompatible."""
    out = engine.generate("Hi", {"regex": "\u2603{1,2}", "max_new_tokens": 16, "temperature": 1})
    assert re.fullmatch("\u2603{1,2}", out["text"])


@pytest.mark.parametrize("temperature", [0, 1])
def test_too_few_tokens_is_marked_incomplete(engine, temperature):
    out = engine.generate(
        "Hi", {"regex": "[a-z]{30}", "max_new_tokens": 3, "temperature": temperature}
    )
    reason = out["meta_info"]["finish_reason"]
    assert reason == {"type": "length", "length": 3, "constraint": "incomplete"}
    assert re.fullmatch("[a-z]{0,29}", out["text"])


@pytest.mark.parametrize(("regex", "complete"), [("[0-9]+", False), ("x*", True), ("a?", True)])
def test_a_prefill_only_request_says_whether_the_empty_text_matches(engine, regex, complete):
    """`max_new_tokens=0` returns '': incomplete unless '' is a full match."""
    out = engine.generate("Hi", {"regex": regex, "max_new_tokens": 0})
    reason = out["meta_info"]["finish_reason"]
    assert out["text"] == "" and reason["type"] == "length"
    assert ("constraint" not in reason) == complete == bool(re.fullmatch(regex, ""))


STOPPED = r"(ab|cd)[0-9]{2,4}x"


@pytest.mark.parametrize("stop", ["string", "token"])
def test_a_stop_the_pattern_took_leaves_its_text_incomplete(engine, stop):
    """The stop's text is not in the output, so a match it completed is cut short: the
    output says so (it once said a plain stop, its text failing `re.fullmatch`)."""
    x = engine.encode("x", add_special_tokens=False)
    by = {"stop": ["x"]} if stop == "string" else {"stop_token_ids": x}
    out = engine.generate("hi", {"regex": STOPPED, "temperature": 0, "max_new_tokens": 20, **by})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "stop" and reason["matched"] in ("x", *x), reason
    assert reason.get("constraint") == "incomplete" and not re.fullmatch(STOPPED, out["text"])
    # A stop cutting nothing of a full match: a complete output.
    free = {"regex": r"(ab|cd)[0-9]{2}(;[0-9])?", "temperature": 0, "max_new_tokens": 20}
    out = engine.generate("hi", {**free, "stop": [";"]})
    assert "constraint" not in out["meta_info"]["finish_reason"]
    assert re.fullmatch(r"(ab|cd)[0-9]{2}", out["text"])


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "time"},  # (once: a backslash and any character)
        {"type": "string", "format": "date"},  # (once: Unicode digits, June 31)
        {"type": "string", "format": "date-time"},  # (once: February 31, no offset)
        {"type": "string", "pattern": "a|b"},  # (once: the quotes inside the branches)
        {"type": "string", "pattern": "^x.{2,6}$"},  # (once: any character in the dot)
    ],
)
def test_sampled_strings_of_formats_and_patterns_are_valid_json(engine, schema):
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    outs = engine.generate(
        ["t: "] * 16,
        [
            {
                "json_schema": json.dumps(schema),
                "temperature": 1.0,
                "seed": seed,
                "max_new_tokens": 160,
            }
            for seed in range(16)
        ],
    )
    complete = [o for o in outs if "constraint" not in o["meta_info"]["finish_reason"]]
    assert complete
    for out in complete:
        value = json.loads(out["text"])
        jsonschema.validate(value, schema, format_checker=checker)
        if schema.get("format") == "date-time":  # (jsonschema checks it only with a plug-in)
            # (3.10's fromisoformat takes no "Z", and fractions of 3 or 6 digits only)
            iso = re.sub(r"(\.[0-9]+)", lambda m: m.group(1).ljust(7, "0")[:7], value)
            parsed = datetime.datetime.fromisoformat(iso.replace("Z", "+00:00"))
            assert parsed.tzinfo is not None, value


def test_frontend_keeps_an_incomplete_constrained_gen_and_says_so(engine):
    """As in SGLang: a constrained gen cut short by max_tokens keeps its partial text."""

    @lp.function
    def short(s):
        s += "Word:" + lp.gen("x", regex="[a-z]{30}", max_tokens=3)

    for state in [short.run(backend=engine), *short.run_batch([{}], backend=engine)]:
        assert state.error() is None
        assert re.fullmatch("[a-z]{0,29}", state["x"]) and state.text() == "Word:" + state["x"]
        reason = state.get_meta_info("x")["finish_reason"]
        assert reason == {"type": "length", "length": 3, "constraint": "incomplete"}


def test_frontend_dtypes_schemas_and_one_compile_per_schema(engine, monkeypatch):
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):
        name_7f3a: str = pydantic.Field(max_length=6)  # a name no other test compiles
        ok: bool
        kind: str = pydantic.Field(json_schema_extra={"enum": ["a", "b"]})

    schema = {
        "type": "object",
        "properties": {"flag_7f3a": {"type": "boolean"}},
        "required": ["flag_7f3a"],
    }
    engine.grammar("regex", "a")  # builds the grammar cache
    compiles = []
    backend = engine._grammars.backend
    original = backend.schema_to_regex
    monkeypatch.setattr(backend, "schema_to_regex", lambda s: compiles.append(s) or original(s))

    @lp.function
    def prog(s, i):
        s += f"Case {i}. Count:" + lp.gen_int("n", max_tokens=48, temperature=0)
        s += " Sure? " + lp.gen("b", dtype=bool, max_tokens=8, temperature=1)
        s += " JSON:" + lp.gen("j", json_schema=schema, max_tokens=48, temperature=1)
        s += " Item:" + lp.gen("p", json_schema=Item, max_tokens=96, temperature=1)

    states = prog.run_batch([{"i": i} for i in range(4)], backend=engine)
    states.append(prog.run(i=9, backend=engine))
    for state in states:
        assert state.error() is None
        # As in SGLang, a typed gen's value is its text; a number's end is consumed.
        assert re.fullmatch(r"-?(0|[1-9][0-9]{0,17})", state["n"]), state["n"]
        assert f"Count:{state['n']} Sure? {state['b']} JSON:" in state.text()
        assert state["b"] in ("True", "False")
        jsonschema.validate(json.loads(state["j"]), schema)
        Item.model_validate_json(state["p"])
        jsonschema.validate(json.loads(state["p"]), Item.model_json_schema())
    assert len(compiles) == 2  # each schema compiled once, across 5 programs
    keys = [k for k in engine._grammars._entries if "7f3a" in k[1]]
    assert len(keys) == 2


def test_pydantic_models_nested_six_deep_keep_their_fields(engine):
    """outlines-core left out every property past the fifth model (its default
    max_recursion_depth): required fields went missing, or a trailing comma came out."""
    pydantic = pytest.importorskip("pydantic")

    class Region(enum.Enum):  # (the fifth $ref: it was left out, after a forced comma)
        north = "north"
        south = "south"

    class Country(pydantic.BaseModel):
        code: str = pydantic.Field(max_length=3)
        region: Region

    class Address(pydantic.BaseModel):
        country: Country

    class Account(pydantic.BaseModel):
        address: Address

    class Customer(pydantic.BaseModel):
        account: Account

    class Order(pydantic.BaseModel):
        customer: Customer
        total: int = pydantic.Field(ge=0, le=99)

    _sampled_documents_validate(engine, Order, "o: ", 120)


def _sampled_documents_validate(engine, model, prompt: str, max_new_tokens: int) -> None:
    """Six sampled documents of `model`'s schema: each one completed validates with it."""
    params = {
        "json_schema": json.dumps(model.model_json_schema()),
        "max_new_tokens": max_new_tokens,
    }
    outs = engine.generate(
        [prompt] * 6, [{**params, "temperature": 1.0, "seed": s} for s in range(6)]
    )
    complete = [o for o in outs if "constraint" not in o["meta_info"]["finish_reason"]]
    assert complete
    for out in complete:
        model.model_validate_json(out["text"])


def test_a_pydantic_model_of_urls_gives_urls_pydantic_takes(engine):
    """HttpUrl writes `maxLength` next to `format: uri`, which was refused; and the `uri`
    pattern let out ports past 65535 and `ftp://`, which HttpUrl refuses."""
    pydantic = pytest.importorskip("pydantic")

    class Site(pydantic.BaseModel):
        home: pydantic.HttpUrl
        mirror: pydantic.AnyUrl

    _sampled_documents_validate(engine, Site, "site: ", 300)


def test_min_new_tokens_with_a_constraint_does_not_break_other_requests(engine):
    """BUG: when the pattern is complete before min_new_tokens, the sampler masks EOS (min
    tokens) and everything else (grammar): all -inf. Greedy silently ends early (argmax of
    all -inf is token 0, the EOS); sampling raises in the engine step, which fails every
    request of that step, the unconstrained one running beside it included."""
    free = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
    alone = engine.generate("Hello there", free)
    constrained = {"regex": "ab", "min_new_tokens": 4, "max_new_tokens": 8, "temperature": 1}
    engine.grammar("regex", "ab")  # compiled up front: the request joins the running batch
    join = _start(engine, "Hello there", free)
    try:
        out = engine.generate("Hi", constrained)
    except ValueError:
        out = None  # refusing the combination at submit time would be fine
    except RuntimeError as error:
        out = error
    result = join()
    assert result.get("output_ids") == alone["output_ids"], result.get("error")
    assert out is None or (isinstance(out, dict) and out["text"] == "ab"), out


def test_number_digit_limits_never_give_invalid_json(engine):
    """BUG (outlines-core translation passed through): maxDigitsFraction / maxDigitsExponent
    without their min give `(\\.[0-9]{0,2})?` / `([eE][+-][0-9]{0,2})?`, so "1." and "1e+"
    are complete matches, yet not JSON."""
    for schema, text in [
        ({"type": "number", "maxDigitsFraction": 2}, "1."),
        ({"type": "number", "maxDigitsExponent": 2}, "1e+"),
    ]:
        try:
            grammar = engine.grammar("json_schema", json.dumps(schema))
        except ValueError:
            continue  # refusing the keyword would be fine
        matcher, vocab = grammar.new_matcher(), engine.runner.model_config.vocab_size
        for token in engine.encode(text, add_special_tokens=False):
            if not matcher.allowed_mask(vocab)[token]:
                break
            matcher.advance(token)
        else:
            assert not matcher.is_complete(), f"{text!r} is a full match for {schema}"


# ---- bounded integers ---------------------------------------------------------------
@HYPO
# Ranges where a value is a prefix of another ("1" of "12", "-1" of "-15"): the index must
# let a complete value go on to the longer one.
@example(lo=0, size=120, prompt="Hi", seed=0)
@example(lo=-15, size=22, prompt="Hi", seed=1)
@given(
    st.integers(-1000, 1000),
    st.integers(0, 4),
    st.sampled_from(PROMPTS),
    st.integers(0, 2**31),
)
def test_sampled_integers_stay_in_range_and_every_value_is_reachable(
    engine, lo, size, prompt, seed
):
    """Random sampling on the tiny model stays inside [lo, lo + size]; the compiled token
    index itself accepts every value of the range, in the tokens the tokenizer gives it,
    and no value just outside it (every value is reachable)."""
    hi = lo + size
    schema = json.dumps({"type": "integer", "minimum": lo, "maximum": hi})
    params = {"json_schema": schema, "max_new_tokens": 8, "temperature": 1.5, "seed": seed}
    for out in engine.generate([prompt] * 4, [{**params, "seed": seed + i} for i in range(4)]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert lo <= int(out["text"]) <= hi, (lo, hi, out["text"])
    grammar = engine.grammar("json_schema", schema)
    for value in range(lo - 2, hi + 3):
        assert _index_accepts(engine, grammar, str(value)) == (lo <= value <= hi), value


def _index_accepts(engine, grammar, text):
    matcher, vocab = grammar.new_matcher(), engine.runner.model_config.vocab_size
    for token in engine.encode(text, add_special_tokens=False):
        if not matcher.allowed_mask(vocab)[token]:
            return False
        matcher.advance(token)
    return matcher.is_complete()


@pytest.mark.parametrize(
    "schema",
    [
        {"enum": [1, 12, 123, "a", -4, -45]},  # some values are prefixes of others
        {"type": "number", "minimum": -20, "maximum": 20},
        {"type": "integer", "exclusiveMinimum": -130, "maximum": 130},
    ],
)
def test_every_value_of_a_small_schema_is_reachable(engine, schema):
    """The compiled index accepts every integer and enum value the schema allows
    (`jsonschema` decides), and nothing it refuses, halves included. (Halves of a bounded
    number may be refused although valid: outlines-core's index drops some tokens that run
    through a complete match, as "19" in "-19.5" runs through "-1"; never an invalid one.)"""
    grammar = engine.grammar("json_schema", json.dumps(schema))
    values = [*schema.get("enum", []), *range(-140, 141), *(n + 0.5 for n in range(-25, 25))]
    for value in values:
        valid = jsonschema.Draft7Validator(schema).is_valid(value)
        accepted = _index_accepts(engine, grammar, json.dumps(value))
        assert accepted == valid or (valid and isinstance(value, float)), (schema, value)
