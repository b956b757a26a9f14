"""Token healing (`lmprog_runtime/token_healing.py`) against independent references: the
first tokens it allows against a scan of the vocabulary through the tokenizer's own tokens
and the GPT-2 byte table of `transformers`, the healed greedy output against transformers'
forward under that mask and its greedy `generate` after it, the text against the
tokenizer's full decode; both engine loops, streaming and stop strings."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy_ids
from hypothesis import given
from hypothesis import strategies as st
from overlap_engines import engine_pair
from transformers.convert_slow_tokenizer import bytes_to_unicode

# Prompts whose last token other tokens extend: a lone space, a word piece, a newline.
PROMPTS = [
    "Name: ",
    "The answer is ",
    "def add(a, b):\n    return a",
    "Once upon a ti",
    "She said hel",
]


def vocab_bytes(tokenizer) -> dict[int, bytes]:
    """Each ordinary token's bytes, read from its piece through GPT-2's byte table."""
    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = {}
    for token_id, piece in enumerate(tokenizer.convert_ids_to_tokens(range(len(tokenizer)))):
        if token_id not in special and piece is not None and all(c in to_byte for c in piece):
            out[token_id] = bytes(to_byte[c] for c in piece)
    return out


@pytest.fixture(scope="module")
def tiny_bytes(hf_tiny):
    return vocab_bytes(hf_tiny[1])


def extends(table: dict[int, bytes], token: int) -> set[int]:
    return {t for t, data in table.items() if data.startswith(table[token])}


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
    assert (
        out["output_ids"]
        == healed_reference(hf_tiny, tiny_bytes, ids, 12)[: len(out["output_ids"])]
    )
    assert len(out["output_ids"]) == 12 or out["meta_info"]["finish_reason"]["type"] == "stop"
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


def test_stop_strings_see_only_the_new_text(engine):
    """The backed-up text is the prompt's: a stop string it holds does not end the output
    at once, and the text is cut where the unstopped output first holds the stop."""
    ids = engine.encode("The answer is ")
    base = {"max_new_tokens": 16, "temperature": 0, "token_healing": True, "ignore_eos": True}
    free = engine.generate(input_ids=ids, sampling_params=base)["text"]
    for stop in [" ", free[1:3], free[-2:]]:
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
    with pytest.raises(ValueError, match="token_healing"):
        engine.generate("Age: ", {"token_healing": True, "regex": "[0-9]+"})
    with pytest.raises(ValueError, match="token_healing"):
        engine.generate("Age: ", {"token_healing": True, "json_schema": '{"type": "integer"}'})
