"""Jump-forward decoding: forced text is appended in one extend step.

References: `re.fullmatch` / `jsonschema`, the same engine with jump-forward off, and the
engine's own forward-pass counter.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from lmprog_runtime import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "customer_full_name_on_the_order": {"type": "string", "maxLength": 6},
        "requested_priority_shipping": {"type": "boolean"},
        "delivery_region_of_the_address": {"enum": ["north", "south"]},
    },
    "required": [
        "customer_full_name_on_the_order",
        "requested_priority_shipping",
        "delivery_region_of_the_address",
    ],
}
PROMPTS = ["Extract: Alice ordered", "Extract: Bob", "Extract the order"]


def _run(engine: Engine, prompts, params):
    engine.reset_stats()
    outs = engine.generate(prompts, params)
    return outs, engine.stats()


@pytest.fixture(scope="module")
def engines(tiny_path):
    with (
        Engine(tiny_path, max_total_tokens=8192) as on,
        Engine(tiny_path, max_total_tokens=8192, disable_jump_forward=True) as off,
    ):
        yield on, off


def test_json_with_long_keys_is_valid_and_needs_few_forwards(engines):
    on, off = engines
    params = {"max_new_tokens": 160, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    outs_on, stats_on = _run(on, PROMPTS, params)
    outs_off, stats_off = _run(off, PROMPTS, params)
    for out in outs_on + outs_off:
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert stats_off["jump_forward_tokens"] == 0 and stats_on["jump_forward_tokens"] > 40
    tokens = sum(len(o["output_ids"]) for o in outs_on) / len(outs_on)
    assert stats_on["forward_passes"] / tokens <= 0.5
    assert stats_on["forward_passes"] < stats_off["forward_passes"] / 2


@pytest.mark.parametrize(
    "regex",
    [r"[0-9]{2}-confirmed-by-the-warehouse", r"(yes|no) - the parcel was delivered", r"[a-c]{3}"],
)
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_free_text_then_forced_text_is_identical_with_jump_forward_on_and_off(
    engines, regex, temperature
):
    on, off = engines
    params = {"max_new_tokens": 48, "temperature": temperature, "seed": 3, "regex": regex}
    texts = {}
    for name, engine in (("on", on), ("off", off)):
        outs, _ = _run(engine, PROMPTS, params)
        texts[name] = [o["text"] for o in outs]
        assert all(re.fullmatch(regex, t) for t in texts[name])
    assert texts["on"] == texts["off"]


def test_mixed_batch_with_jump_forward_equals_each_alone(engines):
    on, _ = engines
    requests = [
        ("Extract: Alice", {"json_schema": json.dumps(SCHEMA)}),
        ("Code:", {"regex": r"[A-Z]{2}-order-number-[0-9]{3}"}),
        ("Once upon a time", {}),
        ("Extract: Bob", {"json_schema": json.dumps(SCHEMA)}),
    ]
    base = {"max_new_tokens": 120, "temperature": 0}
    batch = on.generate([p for p, _ in requests], [{**base, **extra} for _, extra in requests])
    alone = [on.generate(p, {**base, **extra}) for p, extra in requests]
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in alone]
    assert on.memory_state()["kv_slots_locked"] == 0


def test_jump_forward_at_the_start_and_in_a_program(engines):
    import lmprog as lp

    on, _ = engines

    @lp.function
    def extract(s, text):
        s += text + "\n" + lp.gen("record", json_schema=SCHEMA, max_tokens=160)

    state = extract.run(text="Alice ordered", backend=on, temperature=0)
    record = json.loads(state["record"])
    jsonschema.validate(record, SCHEMA)
    assert state["record"].startswith('{"customer_full_name_on_the_order":"')


def test_patterns_too_large_or_too_slow_to_compile_are_refused(tiny_path):
    with Engine(tiny_path, max_total_tokens=1024, grammar_compile_timeout_s=0.005) as engine:
        with pytest.raises(ValueError, match="too large"):
            engine.generate("x", {"regex": "a" * 60_000})
        with pytest.raises(ValueError, match="longer than"):
            engine.generate("x", {"regex": "(a|b)*a(a|b){13}", "max_new_tokens": 4})
        assert len(engine.generate("still serving", {"max_new_tokens": 3})["output_ids"]) == 3
