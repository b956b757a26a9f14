"""Token healing (`lmprog_runtime/token_healing.py`) against independent references: the
first tokens it allows against a scan of the vocabulary through the tokenizer's own tokens
and the GPT-2 byte table of `transformers`, the healed greedy output against transformers'
forward under that mask and its greedy `generate` after it, a constrained request against
a greedy decode under the `regex` module's partial matching, the text against the
tokenizer's full decode; both engine loops, streaming, stop strings and jump-forward."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import hf_greedy_ids, metaspace_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from overlap_engines import engine_pair
from pattern_reference import constrained_reference, extends, vocab_bytes

from lmprog_runtime.token_healing import healed_pattern

# Prompts whose last token other tokens extend: a lone space, a word piece, a newline.
PROMPTS = [
    "Name: ",
    "The answer is ",
    "def add(a, b):\n    return a",
    "Once upon a ti",
    "She said hel",
]


@pytest.fixture(scope="module")
def tiny_bytes(hf_tiny):
    return vocab_bytes(hf_tiny[1])


def allowed_set(engine, token: int) -> set[int]:
    words = engine._healer.extensions(token)
    if words is None:
        return set()
    bits = (words[:, None].to(torch.int64) >> torch.arange(32)) & 1
    return set(bits.flatten().nonzero().flatten().tolist())


@given(token=st.integers(min_value=0, max_value=2047))
def test_allowed_first_tokens_are_the_tokens_that_extend_it(_session_engine, tiny_bytes, token):
    # (the session's engine: the healer holds no request state between examples)
    if token not in tiny_bytes:  # a special token is never healed
        assert _session_engine._healer.extensions(token) is None
        return
    want = extends(tiny_bytes, token)
    got = allowed_set(_session_engine, token)
    assert got == (want if len(want) > 1 else set())


def test_the_healer_keeps_the_masks_used_last(tiny_path, tiny_bytes, monkeypatch):
    """Masks asked for again after others pushed them out are the same; at most
    `MAX_MASKS` are held (a mask a token the prompt ended with grew to 105 MiB over
    SmolLM2's vocabulary)."""
    import lmprog_runtime.token_healing as token_healing
    from lmprog_runtime import Engine

    monkeypatch.setattr(token_healing, "MAX_MASKS", 8)
    tokens = sorted(tiny_bytes)[:40]
    with Engine(tiny_path, max_total_tokens=1024) as engine:
        healer = engine._healer
        first = {t: healer.extensions(t) for t in tokens}
        assert len(healer._words) == 8 and list(healer._words) == tokens[-8:]
        for token in tokens:  # (pushed out and made again)
            again = healer.extensions(token)
            assert (again is None) == (first[token] is None)
            assert again is None or torch.equal(again, first[token])
            want = extends(tiny_bytes, token)
            assert allowed_set(engine, token) == (want if len(want) > 1 else set())
        assert len(healer._words) == 8


def healed_reference(hf_tiny, tiny_bytes, ids: list[int], new: int) -> list[int]:
    """transformers: the prompt less its last token; the first token the argmax of the
    tokens that extend it; then greedy generate."""
    model, _ = hf_tiny
    allowed = sorted(extends(tiny_bytes, ids[-1]))
    with torch.inference_mode():
        logits = model(torch.tensor([ids[:-1]])).logits[0, -1].float()
    first = allowed[int(logits[allowed].argmax())]
    return [first] + hf_greedy_ids(model, [ids[:-1] + [first]], new - 1)[0]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_healed_greedy_matches_transformers(engine, hf_tiny, tiny_bytes, prompt):
    tokenizer = hf_tiny[1]
    ids = engine.encode(prompt)
    assert len(extends(tiny_bytes, ids[-1])) > 1  # (the prompt has something to heal)
    params = {"max_new_tokens": 12, "temperature": 0, "token_healing": True}
    out = engine.generate(input_ids=ids, sampling_params=params)
    # The backed-up token is generated again on top of max_new_tokens.
    want = healed_reference(hf_tiny, tiny_bytes, ids, 13)
    assert out["output_ids"] == want[: len(out["output_ids"])]
    assert len(out["output_ids"]) == 13 or out["meta_info"]["finish_reason"]["type"] == "stop"
    assert tokenizer.decode(out["output_ids"][:1]).startswith(tokenizer.decode(ids[-1:]))
    # The text is what the output adds to the prompt's text.
    full = tokenizer.decode(ids[:-1] + out["output_ids"])
    assert full.startswith(prompt)
    assert out["text"] == full[len(prompt) :]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids) - 1
    assert meta["token_healing"] == {"token_id": ids[-1], "text": tokenizer.decode(ids[-1:])}


def test_nothing_to_heal_is_left_as_it_is(engine, tiny_bytes):
    special = engine.tokenizer.all_special_ids[0]
    prompts = [
        engine.encode("Hello"),  # one token: nothing before it to back up to
        engine.encode("Hello") + [special],  # a special last token
    ]
    lone = [t for t in tiny_bytes if extends(tiny_bytes, t) == {t}]  # extended by none
    prompts.append(engine.encode("Name:") + lone[:1])
    for ids in prompts:
        params = {"max_new_tokens": 6, "temperature": 0}
        plain = engine.generate(input_ids=ids, sampling_params=params)
        healed = engine.generate(input_ids=ids, sampling_params={**params, "token_healing": True})
        assert healed["output_ids"] == plain["output_ids"]
        assert healed["text"] == plain["text"]
        assert "token_healing" not in healed["meta_info"]
        assert healed["meta_info"]["prompt_tokens"] == len(ids)
    # A prompt-only request keeps its whole prompt (and its prompt logprobs).
    ids = engine.encode("Name: ")
    params = {"max_new_tokens": 0, "token_healing": True}
    out = engine.generate(
        input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0
    )
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert [t for _, t, _ in out["meta_info"]["input_token_logprobs"]] == ids


def test_stop_strings_see_only_the_new_text(engine):
    """The backed-up text is the prompt's: a stop string it holds does not end the output
    at once, and the text is cut where the unstopped output first holds the stop."""
    ids = engine.encode("The answer is ")
    base = {"max_new_tokens": 16, "temperature": 0, "token_healing": True, "ignore_eos": True}
    free = engine.generate(input_ids=ids, sampling_params=base)["text"]
    stops = [stop for stop in (" ", free[1:3], free[6:8]) if "\ufffd" not in stop]
    assert len(stops) >= 2 and all(stops)
    for stop in stops:
        out = engine.generate(input_ids=ids, sampling_params={**base, "stop": stop})
        cut = free.find(stop)
        assert out["text"] == free[:cut]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("worker", ["worker_thread", "loop_thread"])
def test_both_loops_heal_alike_and_stream_the_same_text(tiny_path, worker):
    params = [
        {"max_new_tokens": 10, "temperature": 0, "token_healing": True},
        {"max_new_tokens": 7, "temperature": 0.8, "seed": 3, "token_healing": True},
        {"max_new_tokens": 9, "temperature": 0, "token_healing": True, "stop": "a"},
        {"max_new_tokens": 8, "temperature": 0},
    ]
    with engine_pair(tiny_path, worker) as (sync, overlapped):
        outs = []
        for eng in (sync, overlapped):
            batch = eng.generate(PROMPTS[:4], params)
            streamed = [
                "".join(c["text"] for c in eng.generate(p, q, stream=True))
                for p, q in zip(PROMPTS[:4], params)
            ]
            outs.append((batch, streamed))
        (sync_out, sync_stream), (over_out, over_stream) = outs
        assert [o["output_ids"] for o in sync_out] == [o["output_ids"] for o in over_out]
        assert [o["text"] for o in sync_out] == [o["text"] for o in over_out]
        assert sync_stream == [o["text"] for o in sync_out] == over_stream
        assert ["token_healing" in o["meta_info"] for o in sync_out] == [True, True, True, False]


def test_bad_token_healing_is_refused_early(engine):
    with pytest.raises(TypeError, match="token_healing"):
        engine.generate("Name: ", {"token_healing": "yes"})


@given(text=st.text(min_size=1, max_size=6), tail=st.from_regex(r"[0-9]{1,3}", fullmatch=True))
def test_healed_pattern_is_the_text_then_the_pattern(text, tail):
    """Both regex readers the engine uses (Python's `re`, and jump-forward's automaton)
    read the text literally, whatever characters it holds."""
    from lmprog_runtime.constrained.jump_forward import CharFSM
    from lmprog_runtime.regex_nfa import FINAL

    pattern = healed_pattern(text, "[0-9]{1,3}")
    assert re.fullmatch(pattern, text + tail)
    assert not re.fullmatch(pattern, text) and not re.fullmatch(pattern, text + "a" + tail)
    fsm = CharFSM(pattern)
    assert FINAL in fsm.walk(text + tail)
    assert FINAL not in fsm.walk(text) and fsm.walk(text + "a" + tail) is None


@pytest.mark.parametrize(
    "prompt, pattern", [("Age: ", "[0-9]{1,3}"), ("The answer is ", "(yes|no|maybe)")]
)
def test_a_constrained_request_heals_into_its_pattern(engine, hf_tiny, tiny_bytes, prompt, pattern):
    ids = engine.encode(prompt)
    params = {"max_new_tokens": 6, "temperature": 0, "token_healing": True, "regex": pattern}
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert out["output_ids"] == constrained_reference(hf_tiny, tiny_bytes, ids, pattern, 7)
    assert re.fullmatch(pattern, out["text"])
    assert out["meta_info"]["token_healing"]["token_id"] == ids[-1]
    full = hf_tiny[1].decode(ids[:-1] + out["output_ids"], skip_special_tokens=True)
    assert full == prompt + out["text"]


@pytest.mark.parametrize("pattern", [r"(?u)[a-z]{1,3}", r"(?#flags next)(?u)[a-z]{1,3}"])
def test_a_pattern_with_the_unicode_flag_heals(engine, pattern):
    """`(?u)`, a no-op on a text pattern, is still a global flag: behind the backed-up
    text Python's `re` refused it, so only a healed request failed."""
    params = {"max_new_tokens": 4, "temperature": 0, "regex": pattern}
    plain = engine.generate("Name: ", {**params, "token_healing": False})
    healed = engine.generate("Name: ", {**params, "token_healing": True})
    assert re.fullmatch(pattern, plain["text"]) and re.fullmatch(pattern, healed["text"])
    assert healed["meta_info"]["token_healing"]["text"] == " "


def test_a_pattern_at_the_size_limit_heals(engine):
    """The limit on a pattern's length is the caller's: a healed one (the backed-up text in
    front) was refused with a length the caller never wrote."""
    from lmprog_runtime.constrained.grammar_cache import MAX_PATTERN_CHARS

    pattern = "[" + "a" * (MAX_PATTERN_CHARS - 8) + "b]{1,3}"
    assert len(pattern) == MAX_PATTERN_CHARS
    params = {"max_new_tokens": 3, "temperature": 0, "regex": pattern, "token_healing": True}
    out = engine.generate("Name: ", params)
    assert re.fullmatch(pattern, out["text"])
    with pytest.raises(ValueError, match=f"{MAX_PATTERN_CHARS + 1} > {MAX_PATTERN_CHARS}"):
        engine.generate("Name: ", {**params, "regex": pattern + "b"})


def test_a_healed_json_request_jumps_forward_and_validates(engine):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
    }
    params = {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)}
    engine.reset_stats()
    out = engine.generate("Result: ", {**params, "token_healing": True})
    jumped = engine.stats()["jump_forward_tokens"]
    jsonschema.validate(json.loads(out["text"]), schema)
    assert out["meta_info"]["token_healing"]["text"] == " "
    assert jumped > 0  # the keys after the first token came forced
    full = engine.decode(engine.encode("Result: ")[:-1] + out["output_ids"])
    assert full == "Result: " + out["text"]


def test_a_token_whose_text_is_not_its_bytes_is_not_healed():
    """The mask and a healed pattern read a token's bytes: where its text in context
    differs (a SentencePiece word first in the text decodes without its space), healing
    would forbid the prompt's own token; such a prompt is left as it is."""
    import threading

    from lmprog_runtime.token_healing import TokenHealer

    tokenizer = metaspace_tokenizer()
    healer = TokenHealer(tokenizer, threading.Lock(), len(tokenizer))
    first, second = tokenizer("Hi").input_ids, tokenizer("Hi Hi").input_ids
    assert tokenizer.convert_ids_to_tokens(second) == ["<s>", "▁Hi", "▁Hi"]
    assert tokenizer.decode(first, skip_special_tokens=True) == "Hi"  # (no space)
    assert healer.plan(first, skip_special_tokens=True) is None
    heal = healer.plan(second, skip_special_tokens=True)
    assert heal is not None and heal.text == " Hi"
    bits = (heal.words[:, None].to(torch.int64) >> torch.arange(32)) & 1
    allowed = bits.flatten().nonzero().flatten().tolist()
    assert tokenizer.convert_ids_to_tokens(allowed) == ["▁Hi", "▁Hi!"]


def test_special_tokens_outside_all_special_ids_are_never_drawn(tiny_path):
    """A token marked special only among the added tokens (not in `all_special_ids`) is
    skipped by a decode: drawn as the healed token, or under a grammar, it would lose
    text."""
    import threading

    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from lmprog_runtime.token_healing import TokenHealer

    tokenizer = AutoTokenizer.from_pretrained(tiny_path)
    table = vocab_bytes(tokenizer)
    space = tokenizer.convert_tokens_to_ids("Ġ")
    word = next(t for t in sorted(extends(table, space)) if t != space)
    piece = tokenizer.convert_ids_to_tokens(word)
    tokenizer.add_tokens([AddedToken(piece, special=True)], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(piece) == word
    assert word not in tokenizer.all_special_ids  # (marked special among the added only)
    healer = TokenHealer(tokenizer, threading.Lock(), len(tokenizer))
    bits = (healer.extensions(space)[:, None].to(torch.int64) >> torch.arange(32)) & 1
    allowed = set(bits.flatten().nonzero().flatten().tolist())
    assert allowed == extends(table, space) - {word}
    # Nor may a grammar draw it: the constrained vocabulary leaves it out too.
    from lmprog_runtime.constrained.outlines_backend import token_bytes

    assert word not in token_bytes(tokenizer) and space in token_bytes(tokenizer)


def test_min_new_tokens_counts_on_top_of_the_healed_token(engine):
    """The backed-up token, generated again, comes on top of min_new_tokens as of
    max_new_tokens: a one-character stop string in its text does not count yet."""
    prompt = "The answer is "
    ids = engine.encode(prompt)
    base = {"max_new_tokens": 12, "temperature": 0, "token_healing": True, "ignore_eos": True}
    free = engine.generate(input_ids=ids, sampling_params=base)
    first = engine.decode(ids[:-1] + free["output_ids"][:1])[len(prompt) :]
    assert first  # (the healed token adds text of its own)
    stop = first[0]
    out = engine.generate(
        input_ids=ids, sampling_params={**base, "stop": stop, "min_new_tokens": 1}
    )
    cut = free["text"].find(stop, len(first))
    assert out["text"] == (free["text"] if cut < 0 else free["text"][:cut])


def test_a_healed_constrained_output_cut_by_a_stop_is_complete_when_it_matches(engine):
    """The kept text was matched against the healed pattern (backed-up text first) without
    that text: a full match was reported incomplete. Reference: `re.fullmatch`."""
    regex = "[0-9]+( [a-z]+)?"
    base = {"temperature": 0, "max_new_tokens": 8, "regex": regex, "stop": " "}
    for prompt in ("Age: ", "Count: ", "Year: "):
        out = engine.generate(prompt, {**base, "token_healing": True})
        assert out["meta_info"]["token_healing"]  # (what the test is about)
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "stop"
        assert ("constraint" in reason) == (re.fullmatch(regex, out["text"]) is None), out


def test_the_backed_up_token_written_again_is_not_a_stop_token(engine):
    """A stop token id is new output's: the healed first draw writing the prompt's own
    token again once ended the request at once with an empty text (stop strings already
    skipped that text), and `min_new_tokens` banned it from that draw."""
    ids = engine.encode("The answer is")
    base = {"max_new_tokens": 5, "temperature": 0, "token_healing": True, "ignore_eos": True}
    free = engine.generate(input_ids=ids, sampling_params=base)
    assert free["output_ids"][0] == ids[-1]  # (what the test is about: the same token again)
    for extra in ({}, {"min_new_tokens": 1}):
        params = {**base, **extra, "stop_token_ids": [ids[-1]]}
        out = engine.generate(input_ids=ids, sampling_params=params)
        assert out["output_ids"] == free["output_ids"] and out["text"] == free["text"]
