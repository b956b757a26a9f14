"""Engines on SentencePiece-style tokenizers, built by hand (a Metaspace pre-tokenizer and a
decoder that strips the text's first space; byte-fallback pieces, `<0xE6>`): the output's
text, whole and streamed, is what it adds to the prompt's full decode, and jump-forward
goes on them as on a byte-level BPE vocabulary."""

from __future__ import annotations

import re

import pytest


def _engine_with(tokenizer, path):
    """An engine on a random tiny Llama with `tokenizer`, saved under `path`."""
    from helpers import TINY_ARCH_CONFIG, random_hf_model

    from lmprog_runtime import Engine

    model = random_hf_model(
        "llama",
        **{**TINY_ARCH_CONFIG, "vocab_size": len(tokenizer)},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return Engine(str(path), max_total_tokens=2048, dtype="float32")


@pytest.fixture(scope="module")
def metaspace_engine(tmp_path_factory):
    """An engine on a random tiny Llama whose tokenizer is SentencePiece-style (Metaspace,
    a decoder that strips the text's first space)."""
    from helpers import metaspace_tokenizer

    tokenizer = metaspace_tokenizer()
    engine = _engine_with(tokenizer, tmp_path_factory.mktemp("metaspace"))
    yield engine, tokenizer
    engine.shutdown()


def test_byte_fallback_outputs_stream_the_final_text(tmp_path):
    """Random weights draw byte pieces in every order, runs that are not UTF-8 included:
    whole and streamed, the text is what the output adds to the prompt's full decode."""
    from helpers import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer(extra=("\ufffd",))
    with _engine_with(tokenizer, tmp_path) as engine:
        ids = tokenizer("ab").input_ids
        for seed in range(12):
            params = {"max_new_tokens": 24, "temperature": 8.0, "seed": seed, "ignore_eos": True}
            _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params)
        # A prompt ending in a U+FFFD of its own (three byte pieces, a whole character; or
        # the vocabulary's own piece), then a spaced word: the prompt's tokens were taken to
        # end inside a character and left out of the output's decode, which then lost its
        # leading space.
        params = {"max_new_tokens": 4, "temperature": 0, "regex": " ab"}
        for end in (["<0xEF>", "<0xBF>", "<0xBD>"], ["\ufffd"]):
            ids = tokenizer("ab").input_ids + tokenizer.convert_tokens_to_ids(end)
            out = _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params)
            assert out["text"] == " ab", end
        # A prompt ending inside a character (half an emoji): the output is read after the
        # tokens before its byte pieces, and keeps its leading space (it was read alone,
        # and `" ab"` came out as "ab", which its own pattern does not match).
        half = tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9F>"])
        for before in ("ab", "ab 日"):  # (the second's byte pieces outrun the context)
            ids = tokenizer(before).input_ids + half
            out = engine.generate(input_ids=ids, sampling_params=params)
            streamed = engine.generate(input_ids=ids, sampling_params=params, stream=True)
            assert out["text"] == "".join(c["text"] for c in streamed) == " ab", before


def test_jump_forward_after_a_character_in_byte_fallback_pieces(tmp_path):
    """A run of byte-fallback pieces is held back until a piece of another kind follows
    (one more byte that is not UTF-8 turns the whole run into U+FFFD), and the jump waited
    for it: the model drew the first forced token itself. Once the run decodes as whole
    characters, the forced text ends it and the jump goes: only the first character's
    bytes are drawn."""
    from helpers import byte_fallback_tokenizer

    tokenizer = byte_fallback_tokenizer()
    with _engine_with(tokenizer, tmp_path) as engine:
        ids = tokenizer("ab").input_ids
        for regex in ("(日|中) ab ab ab", "(日本|中国) ab ab", "(🙂|✅)ab ab", "(é|ü) ab ab"):
            params = {"max_new_tokens": 30, "temperature": 0, "regex": regex}
            engine.reset_stats()
            out = engine.generate(input_ids=ids, sampling_params=params)
            stats = engine.stats()
            assert re.fullmatch(regex, out["text"]), (regex, out["text"])
            again = _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params)
            assert again["output_ids"] == out["output_ids"]
            drawn = len(out["text"][0].encode())  # (the first byte comes with the prefill)
            assert stats["decode_tokens"] == drawn - 1, (regex, stats)


@pytest.mark.parametrize("prompt", ["Hi", "Hi Hi", "Hi!"])
def test_an_output_keeps_its_leading_space_after_the_prompt(metaspace_engine, prompt):
    """A SentencePiece word's space is part of the output's text after a prompt, as in the
    full decode (it is stripped only first in a text): the text is what the output adds
    to the prompt's decode, whole and streamed."""
    engine, tokenizer = metaspace_engine
    ids = tokenizer(prompt).input_ids
    spaced = 0
    for seed in range(8):
        params = {"max_new_tokens": 5, "temperature": 8.0, "seed": seed, "ignore_eos": True}
        out = _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params)
        pieces = tokenizer.convert_ids_to_tokens(out["output_ids"])
        words = [p for p in pieces if p not in tokenizer.all_special_tokens]
        spaced += bool(words) and words[0].startswith("▁")
    assert spaced  # (some text began with a spaced word: the case that was lost)


@pytest.mark.parametrize("regex", [" Hi!", " Hi!( Hi)?", "( Hi)+!"])
def test_jump_forward_at_the_start_keeps_a_sentencepiece_words_space(metaspace_engine, regex):
    """A constrained output that begins with forced text (jumped over at the start, before
    any draw) on a SentencePiece-style tokenizer: the forced " Hi!" goes in as the
    tokenizer's own token `▁Hi!`, and the text keeps its leading space, whole and streamed,
    as the full decode has it."""
    engine, tokenizer = metaspace_engine
    ids = tokenizer("Hi").input_ids
    params = {"max_new_tokens": 8, "temperature": 0, "regex": regex}
    out = _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params)
    assert re.fullmatch(regex, out["text"])
    if regex.startswith(" Hi!"):  # (forced whole: jumped, not drawn as ▁H, i, !)
        assert tokenizer.convert_ids_to_tokens(out["output_ids"])[0] == "▁Hi!"


@pytest.mark.parametrize("regex", ["(!|i) Hi! Hi!", "(!|i)!Hi Hi!"])
def test_jump_forward_after_a_draw_on_a_sentencepiece_tokenizer(metaspace_engine, regex):
    """After a drawn token, the forced text is retokenized with it as inside a text: the
    tokenizer begins a text with `▁`, so a plain encode of "! Hi! Hi!" began with a space
    the pattern refused, and every jump was dropped (the tokens were drawn one by one)."""
    engine, tokenizer = metaspace_engine
    ids = tokenizer("Hi").input_ids
    before = engine.stats()["jump_forward_tokens"]
    params = {"max_new_tokens": 12, "temperature": 0, "regex": regex}
    out = engine.generate(input_ids=ids, sampling_params=params)
    assert re.fullmatch(regex, out["text"])
    assert engine.stats()["jump_forward_tokens"] > before
    full = tokenizer.decode(ids + out["output_ids"], skip_special_tokens=True)
    assert full == "Hi" + out["text"]


def _generated_as_the_full_decode_has_it(engine, tokenizer, ids, params):
    """`engine.generate`'s output for `ids`, asserted to read, whole and streamed, as what
    the output adds to the prompt's full decode."""
    out = engine.generate(input_ids=ids, sampling_params=params)
    streamed = "".join(
        c["text"] for c in engine.generate(input_ids=ids, sampling_params=params, stream=True)
    )
    before = tokenizer.decode(ids, skip_special_tokens=True)
    full = tokenizer.decode(ids + out["output_ids"], skip_special_tokens=True)
    assert out["text"] == full[len(before) :] == streamed
    return out
