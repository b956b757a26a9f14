"""Jump-forward decoding: forced text is appended in one extend step.

References: `re.fullmatch` / `jsonschema`, the same engine with jump-forward off, and the
engine's own forward-pass counter.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import jsonschema
import pytest

from lmprog_runtime import Engine
from lmprog_runtime.constrained.jump_forward import MAX_JUMP_CHARS
from lmprog_runtime.penalties import PenaltyCounts

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


def _fresh_prefill_logprobs(engine: Engine, prompt_ids: list[int], out_ids: list[int]):
    """(logprob, token) of each output token but the last, from one prefill of the prompt
    and output together."""
    return engine.generate(
        input_ids=prompt_ids + out_ids[:-1],
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(prompt_ids),
    )["meta_info"]["input_token_logprobs"]


# A character drawn as several byte tokens, then forced text, then text to sample: the jump
# retokenizes all the character's tokens (the last alone decodes to no text of its own).
CJK_THEN_FORCED = r"(日本|中国)-confirmed-by-the-warehouse-[a-z]{3}"


@pytest.mark.parametrize(
    "constraint, per_request",
    [({"json_schema": json.dumps(SCHEMA)}, 3), ({"regex": CJK_THEN_FORCED}, 4)],
)
@pytest.mark.parametrize("disable_radix_cache", [False, True])
def test_tokens_after_a_jump_see_the_kv_of_a_fresh_prefill_of_the_same_ids(
    engines, tiny_path, monkeypatch, disable_radix_cache, constraint, per_request
):
    """After a jump the engine must sample from the logits a plain prefill of
    prompt + output so far gives: no stale K/V of the retokenized tokens, no wrong positions
    or slots, no cached K/V of another tokenization. Reference: prompt logprobs of the
    final token ids from the engine with jump-forward off (one fresh prefill)."""
    import lmprog_runtime.step_draw as step_draw

    _, off = engines
    rows = {}  # (rid, output length when sampled) -> log-softmax of the raw logits
    real_sample_each = step_draw.sample_each
    live = {}  # the engine's requests by id (its loop thread samples them)

    def spy(logits, sample_rows):
        for row, sample_row in zip(logits.float(), sample_rows):
            req = live[sample_row.rid]
            rows[(req.rid, len(req.output_ids))] = row.log_softmax(-1)
        return real_sample_each(logits, sample_rows)

    monkeypatch.setattr(step_draw, "sample_each", spy)
    params = {"max_new_tokens": 160, "temperature": 0, **constraint}
    with Engine(tiny_path, max_total_tokens=8192, disable_radix_cache=disable_radix_cache) as on:
        live = on._live
        on.generate(PROMPTS[:1], params)  # leaves K/V of a jump-forward run in the cache
        outs, stats = _run(on, PROMPTS, params)
        assert stats["jump_forward_tokens"] > 8 * len(PROMPTS)
        checked = 0
        for prompt, out in zip(PROMPTS, outs):
            out_ids = out["output_ids"]
            ref = _fresh_prefill_logprobs(off, on.encode(prompt), out_ids)
            rid = out["meta_info"]["id"]
            for n, token in enumerate(out_ids[:-1]):
                if (rid, n) not in rows:
                    continue  # a forced token: no sampling step
                assert ref[n][1] == token
                assert rows[rid, n][token].item() == pytest.approx(ref[n][0], abs=1e-3)
                checked += 1
        # (a value token after each key's jump; a character's bytes and a letter after)
        assert checked >= per_request * len(PROMPTS)


@pytest.mark.parametrize("char, pieces", [("€", ["â", "Ĥ", "¬"]), ("£", ["Â", "£"])])
def test_a_character_whose_tokens_would_change_is_not_jumped_over(
    engines, monkeypatch, char, pieces
):
    """The tiny tokenizer writes "€" as two tokens, 'âĤ' '¬' (and "£" as one); here the
    model is made to draw its bytes, each a token. Retokenizing them with the forced text
    would change those but the last, whose K/V is in the pool: no jump there (a token
    later, the last token alone is retokenized), and every token drawn after a jump has
    the logits of a fresh prefill."""
    import lmprog_runtime.step_draw as step_draw

    on, off = engines
    tokenizer = on.tokenizer
    char_bytes = tokenizer.convert_tokens_to_ids(pieces)
    assert tokenizer.decode(char_bytes) == char
    assert on.encode(f"{char}-", add_special_tokens=False)[:1] != char_bytes[:1]
    rows, real_sample_each = {}, step_draw.sample_each

    def drawn_as_bytes(logits, sample_rows):
        logits = logits.clone()  # (an inference tensor: not written in place)
        for row, sample_row in zip(logits, sample_rows):
            req = on._live.get(sample_row.rid)
            if req is None:
                continue
            n = len(req.output_ids)
            if n < len(char_bytes):
                row.fill_(float("-inf"))
                row[char_bytes[n]] = 0.0
            else:
                rows[n] = row.float().log_softmax(-1)
        return real_sample_each(logits, sample_rows)

    monkeypatch.setattr(step_draw, "sample_each", drawn_as_bytes)
    regex = r"[€£]-confirmed-by-the-warehouse-[a-z]{3}"
    on.reset_stats()
    out = on.generate("Price: ", {"max_new_tokens": 40, "temperature": 0, "regex": regex})
    assert re.fullmatch(regex, out["text"]) and on.stats()["jump_forward_tokens"] > 8
    out_ids = out["output_ids"]
    assert out_ids[: len(char_bytes)] == char_bytes
    ref = _fresh_prefill_logprobs(off, on.encode("Price: "), out_ids)
    checked = [n for n in rows if n < len(out_ids) - 1]
    for n in checked:
        assert ref[n][1] == out_ids[n]
        assert rows[n][out_ids[n]].item() == pytest.approx(ref[n][0], abs=1e-3)
    assert len(checked) >= 2  # '-' before the jump, a letter after it


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


def test_a_character_drawn_in_byte_tokens_jumps_forward_once_it_is_whole(engines):
    """The tiny model spells each CJK character as three byte tokens. Once the first
    character is whole, the rest is forced: only those tokens are drawn (a jump was made
    one token later: the text before the last byte token ended inside the character)."""
    on, off = engines
    params = {"max_new_tokens": 40, "temperature": 0, "regex": r"(日本|中国)-confirmed"}
    outs_on, stats_on = _run(on, PROMPTS, params)
    outs_off, _ = _run(off, PROMPTS, params)
    assert [o["text"] for o in outs_on] == [o["text"] for o in outs_off]
    assert all(re.fullmatch(params["regex"], o["text"]) for o in outs_on)
    drawn = [len(on.encode(o["text"][0], add_special_tokens=False)) for o in outs_on]
    assert drawn == [3] * len(PROMPTS)
    # the prefill draws a character's first byte, decodes the next two, an extend the EOS
    assert stats_on["decode_tokens"] == sum(n - 1 for n in drawn)


@pytest.mark.parametrize("healing", [False, True])
def test_an_anchored_pattern_jumps_forward_as_the_pattern_unanchored_does(engines, healing):
    """interegular reads no anchor: the edges' are cut for it (`without_edge_anchors`).
    The texts equal jump-forward off's (the tokens differ: forced text is retokenized)."""
    on, off = engines
    prompts = ["Age: ", "Name: ", "The answer is "]  # (each ends in a token that heals)
    base = r"\d{2}-confirmed-by-the-warehouse"  # (`\d`: the portable form has `\u` escapes)
    outputs = []
    for regex in (base, f"^{base}$", rf"\A{base}\Z"):
        params = {"max_new_tokens": 48, "temperature": 1.0, "seed": 3, "regex": regex}
        params["token_healing"] = healing
        outs, stats = _run(on, prompts, params)
        assert stats["jump_forward_tokens"] > 0
        texts = [o["text"] for o in outs]
        assert texts == [o["text"] for o in _run(off, prompts, params)[0]]
        assert all(re.fullmatch(regex, text) for text in texts)
        assert all(("token_healing" in o["meta_info"]) == healing for o in outs)
        outputs.append([o["output_ids"] for o in outs])
    assert outputs[0] == outputs[1] == outputs[2]


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


@pytest.mark.parametrize(
    ("max_running", "count", "policy"),
    [(1, 1, "lpm"), (2, 2, "lpm"), (4, 8, "lpm"), (4, 8, "dfs-weight"), (4, 8, "fcfs")],
)
def test_requests_jumping_forward_with_every_table_row_taken_all_finish(
    engines, tiny_path, max_running, count, policy
):
    """A request that jumps forward waits to extend holding its table row: with every row
    so held nothing was admitted, and the loop failed one as unschedulable. (`dfs-weight`
    orders such requests after those with a cached match: one without a row came first.)"""
    regex = r"The answer is (yes|no)\. Thank you very much for asking!"
    params = {"max_new_tokens": 64, "temperature": 0, "regex": regex}
    prompts = [f"Question {i}:" for i in range(count)]
    alone = [engines[0].generate(p, params)["text"] for p in prompts]
    limits = {"max_running_requests": max_running, "schedule_policy": policy}
    with Engine(tiny_path, max_total_tokens=4096, **limits) as engine:
        assert [o["text"] for o in engine.generate(prompts, params)] == alone
        assert engine.memory_state()["req_slots_free"] == max_running


def test_penalties_count_the_tokens_a_jump_forward_wrote(engines, monkeypatch):
    """Penalties with jump-forward: the tokens a jump appends (or retokenizes) are not
    drawn, so the request's counts are counted again from its output at its next draw.
    Every draw's counts equal its request's output at that draw, as a multiset."""
    on, _ = engines
    held: dict[int, list[int]] = {}  # the output of the request each row is drawn for
    seen: list[tuple[Counter, Counter]] = []
    row_of, apply = PenaltyCounts.row_of, PenaltyCounts.apply

    def recording_row_of(self, req, offset=0, draws=1):
        row = row_of(self, req, offset, draws)
        held[row.row] = list(req.output_ids)
        return row

    def recording_apply(self, logits, rows, weights, where):
        apply(self, logits, rows, weights, where)
        for row in rows:
            tokens = self._counts[row.row].nonzero().flatten().tolist()
            counts = self._counts[row.row][tokens].int().tolist()
            seen.append((Counter(dict(zip(tokens, counts))), Counter(held[row.row])))

    monkeypatch.setattr(PenaltyCounts, "row_of", recording_row_of)
    monkeypatch.setattr(PenaltyCounts, "apply", recording_apply)
    params = {"max_new_tokens": 120, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    params |= {"frequency_penalty": 0.4, "presence_penalty": 0.2}
    outs, stats = _run(on, PROMPTS, params)
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert stats["jump_forward_tokens"] > 40 and len(seen) > 10
    assert all(got == want for got, want in seen)


def test_jump_forward_at_the_start_and_in_a_program(engines):
    import lmprog as lp

    on, _ = engines

    @lp.function
    def extract(s, text):
        s += text + "\n" + lp.gen("record", json_schema=SCHEMA, max_tokens=160)

    state = extract.run(text="Alice ordered", backend=on, temperature=0)
    record = json.loads(state["record"])
    jsonschema.validate(record, SCHEMA)
    assert state["record"].startswith('{"customer_full_name_on_the_order": "')


def test_a_long_constrained_output_decodes_a_window_per_token(engines, monkeypatch):
    """Jump-forward and stop checks decode only new tokens (issue 14): over a long output
    the engine decodes a few ids per output token, not the whole output each time."""
    on, _ = engines
    regex = r'(\{"id": [0-9]{1,3}\}, ){30,}'
    params = {"max_new_tokens": 600, "temperature": 0, "regex": regex}
    decoded = [0]
    real_decode = on.decode

    def counting_decode(ids, skip_special_tokens=True):
        decoded[0] += len(ids)
        return real_decode(ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(on, "decode", counting_decode)
    out = on.generate("List the ids:", params)
    monkeypatch.undo()
    num_tokens = len(out["output_ids"])
    assert num_tokens > 200
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # the pattern never ends
    print(f"{decoded[0]} ids decoded for {num_tokens} output tokens")
    assert decoded[0] <= 30 * num_tokens  # a full decode per token: ~num_tokens^2 / 2


@pytest.mark.parametrize("regex", [r"\u00e9{2}", r"[\u0400-\u04FF]{2}", "(?x) a b c"])
def test_a_pattern_interegular_cannot_read_runs_as_with_jump_forward_off(engines, regex):
    """outlines-core compiles these and interegular (jump-forward's automaton once) could
    not: the request failed with interegular's own error. The output is the one
    jump-forward off gives."""
    on, off = engines
    params = {"regex": regex, "max_new_tokens": 8, "temperature": 0}
    out = on.generate("x", params)
    assert out["output_ids"] == off.generate("x", params)["output_ids"]
    assert "constraint" not in out["meta_info"]["finish_reason"]


def test_stop_token_ids_stop_a_constrained_request_as_with_jump_forward_off(engines):
    """Forced tokens were never checked against `stop_token_ids`: a stop id inside the
    forced text did not stop the request. Requests with stop ids now run without
    jump-forward, so their output is the one jump-forward off gives."""
    on, off = engines
    regex = "The city is (Paris|London)\\."
    base = {"regex": regex, "max_new_tokens": 24, "temperature": 0}
    tokens = off.generate("Capital:", base)["output_ids"]
    assert len(tokens) > 4
    for stop_id in tokens[1:4]:
        params = {**base, "stop_token_ids": [stop_id]}
        expected = off.generate("Capital:", params)
        out = on.generate("Capital:", params)
        assert out["output_ids"] == expected["output_ids"]
        assert out["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        assert out["meta_info"]["finish_reason"]["matched"] == stop_id


LITERAL = "the quick brown fox jumps over " * 100  # (3,100 characters, ~1,240 tokens)


def test_a_forced_text_longer_than_the_tokens_left_is_jumped_up_to_them(engines):
    """A forced text that did not fit in `max_new_tokens` got no jump: the request drew it
    token by token, one forward pass each. It now jumps as far as the tokens left allow."""
    on, off = engines
    regex = "x" + re.escape(LITERAL) + "[a-z]{3}"
    params = {"regex": regex, "max_new_tokens": 50, "temperature": 0}
    out, stats = _run(on, ["Say:"], params)
    (expected,) = off.generate(["Say:"], params)
    for got in (out[0], expected):
        assert len(got["output_ids"]) == 50
        assert got["meta_info"]["finish_reason"]["type"] == "length"
        assert ("x" + LITERAL).startswith(got["text"])
    assert len(out[0]["text"]) >= len(expected["text"]) - 8  # (its own tokenization)
    assert stats["forward_passes"] <= 2 and stats["jump_forward_tokens"] >= 45


def test_a_long_forced_text_is_encoded_and_jumped_a_piece_at_a_time(engines, monkeypatch):
    """Jump-forward encodes at most `MAX_JUMP_CHARS` of forced text at a step, not all of a
    long literal at each step (O(its length) a token), and still needs few forwards."""
    on, _ = engines
    regex = "x" + re.escape(LITERAL) + "[a-z]{3}"
    params = {"regex": regex, "max_new_tokens": 2000, "temperature": 0}
    longest = [0]
    real_encode = on.encode

    def measuring_encode(text, add_special_tokens=True):
        longest[0] = max(longest[0], len(text))
        return real_encode(text, add_special_tokens=add_special_tokens)

    monkeypatch.setattr(on, "encode", measuring_encode)
    (out,), stats = _run(on, ["Say:"], params)
    monkeypatch.undo()
    assert re.fullmatch(regex, out["text"]), out["text"][-40:]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert longest[0] <= MAX_JUMP_CHARS + 16
    assert stats["forward_passes"] <= 8, stats
