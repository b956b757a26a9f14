"""Incremental detokenization (issue 14): each new token costs a decode of a short window,
and the text it builds is the full decode's, checked against `tokenizer.decode` itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from lmprog_runtime import SamplingParams, default_model_path
from lmprog_runtime.request import Req


class CountingCodec:
    """A tokenizer that counts how many ids it was asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path("tiny"))


def _req(codec, **params) -> Req:
    sampling = SamplingParams.from_dict({"max_new_tokens": 10_000, **params})
    return Req(0, [1], sampling, tokenizer=codec, eos_token_ids=frozenset(), context_len=20_000)


def _texts(tokenizer) -> st.SearchStrategy[list[int]]:
    # Text with multi-byte characters and merged pieces, tokenized by the real tokenizer.
    alphabet = st.sampled_from(list("ab cd\n.,'é日本🙂") + [" the", "ing", "  "])
    return st.lists(alphabet, min_size=1, max_size=60).map(
        lambda parts: tokenizer.encode("".join(parts), add_special_tokens=False)
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_incremental_text_is_the_full_decode(tokenizer, data):
    ids = data.draw(_texts(tokenizer))
    ids += data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
    req = _req(CountingCodec(tokenizer))
    for n in range(1, len(ids) + 1):
        req.output_ids.append(ids[n - 1])
        text = req.decoded_text()
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        assert full.startswith(text)
        # Only an incomplete trailing character may be held back.
        assert full[len(text) :] == "" or "\ufffd" in full[len(text) :]
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert req.decoded_text() == full or full.endswith("\ufffd")


def test_decoding_costs_a_window_per_token_not_the_whole_output(tokenizer):
    ids = tokenizer.encode("word " * 1500, add_special_tokens=False)
    codec = CountingCodec(tokenizer)
    req = _req(codec, stop=["never appears"])
    for token in ids:
        req.append_token(token)
    assert not req.is_finished
    assert req.decoded_text() == tokenizer.decode(ids)
    # A full decode per token would decode len(ids)^2 / 2 ids; a window, a few per token.
    assert codec.decoded_ids <= 4 * len(ids)


def test_a_stop_string_across_tokens_is_found_once_it_is_complete(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma", add_special_tokens=False)
    req = _req(tokenizer, stop=["STOP"])
    for token in ids:
        req.append_token(token)
        if req.is_finished:
            break
    assert req.finished_reason == {"type": "stop", "matched": "STOP"}
    req.finalize_text()
    assert req.text == "alpha beta "
