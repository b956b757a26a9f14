"""Incremental detokenization (issue 14): each new token costs a decode of a short window,
and the text it builds is the full decode's, checked against `tokenizer.decode` itself."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lmprog_runtime import SamplingParams, default_model_path
from lmprog_runtime.request import Req
from lmprog_runtime.request_maker import backend_decode
from lmprog_runtime.stop_strings import FIND_EACH_MAX
from lmprog_runtime.token_healing import Heal


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


@pytest.fixture(scope="module", params=[False, True], ids=["windows", "alone"])
def alone(request) -> bool:
    """Whether new tokens decode alone (`context_free_decode`: the tiny model's byte-level
    tokenizer allows it), or after the window before them (any tokenizer)."""
    return request.param


def _req(codec, alone: bool = False, **params) -> Req:
    sampling = SamplingParams.from_dict({"max_new_tokens": 10_000, **params})
    return Req(
        0,
        [1],
        sampling,
        tokenizer=codec,
        eos_token_ids=frozenset(),
        context_len=20_000,
        context_free_decode=alone,
    )


def _texts(tokenizer) -> st.SearchStrategy[list[int]]:
    # Text with multi-byte characters and merged pieces, tokenized by the real tokenizer.
    alphabet = st.sampled_from(list("ab cd\n.,'é日本🙂") + [" the", "ing", "  ", " €"])
    return st.lists(alphabet, min_size=1, max_size=60).map(
        lambda parts: tokenizer.encode("".join(parts), add_special_tokens=False)
    )


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_incremental_text_is_the_full_decode(tokenizer, alone, data):
    ids = data.draw(_texts(tokenizer))
    ids += data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
    req = _req(CountingCodec(tokenizer), alone)
    for n in range(1, len(ids) + 1):
        req.output_ids.append(ids[n - 1])
        text = req.decoded_text()
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        # Only an incomplete trailing character is held back, not the characters of its
        # token before it.
        assert text == full.rstrip("\ufffd")
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert req.decoded_text() == full or full.endswith("\ufffd")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_incremental_text_does_not_depend_on_when_it_is_read(tokenizer, alone, data):
    """Read after some tokens only, the text is what reading after every token gives: a
    trailing incomplete character holds back itself, not the tokens before it."""
    ids = data.draw(_texts(tokenizer))
    reads = data.draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
    every, some = _req(tokenizer, alone), _req(tokenizer, alone)
    for token, read in zip(ids, reads):
        every.output_ids.append(token)
        some.output_ids.append(token)
        every.decoded_text()
        if read:
            assert some.decoded_text() == every.decoded_text()
    assert some.decoded_text() == every.decoded_text()


def test_decoding_costs_a_window_per_token_not_the_whole_output(tokenizer, alone):
    ids = tokenizer.encode("word " * 1500, add_special_tokens=False)
    codec = CountingCodec(tokenizer)
    req = _req(codec, alone, stop=["never appears"])
    for token in ids:
        req.append_token(token)
    assert not req.is_finished
    assert req.decoded_text() == tokenizer.decode(ids)
    # A full decode per token would decode len(ids)^2 / 2 ids; a window, a few per token;
    # alone, each token once.
    assert codec.decoded_ids <= (len(ids) if alone else 4 * len(ids))


def test_a_stop_string_in_the_text_before_min_new_tokens_does_not_count(tokenizer, alone):
    """Whatever other stops are given: each may only end in the text of the
    min_new_tokens-th token or later."""
    ids = tokenizer.encode("xa yz", add_special_tokens=False)
    assert len(ids) >= 3 and tokenizer.decode(ids[:2]) == "xa"
    for stops in (["a"], ["a", "zzzz"]):
        req = _req(tokenizer, alone, stop=stops, min_new_tokens=3)
        _run(req, ids, streamed=False)
        assert req.finished_reason["type"] == "length" and req.text == "xa yz", stops


def test_tokens_without_text_cost_a_window_each(tokenizer, alone):
    """Special tokens (skipped) add no text, so the window grows over them: each new one
    is tried once, not every one of them again on each read."""
    ids = [0] * 400 + tokenizer.encode(" done", add_special_tokens=False)
    codec = CountingCodec(tokenizer)
    req = _req(codec, alone, stop=["zz"])
    for token in ids:
        req.append_token(token)
        req.stream_delta()
    assert req.decoded_text() == " done"
    assert codec.decoded_ids <= len(ids) ** 2  # (cubic: tens of millions)


def test_a_stop_string_across_tokens_is_found_once_it_is_complete(tokenizer, alone):
    ids = tokenizer.encode("alpha beta STOP gamma", add_special_tokens=False)
    req = _req(tokenizer, alone, stop=["STOP"])
    for token in ids:
        req.append_token(token)
        if req.is_finished:
            break
    assert req.finished_reason == {"type": "stop", "matched": "STOP"}
    req.finalize_text()
    assert req.text == "alpha beta "


def test_a_healed_text_decodes_after_the_window_even_where_tokens_decode_alone(tokenizer):
    """A healed output's text starts past the healed text (`Heal.cut`): it is decoded as
    by windows, with a context-free tokenizer too (here a heal with no context tokens)."""
    ids = tokenizer.encode("alpha beta gamma", add_special_tokens=False)
    first = tokenizer.decode(ids[:1])
    heal = Heal(ids[0], first, [], len(first), torch.zeros(1, dtype=torch.int32))
    texts = []
    for alone in (False, True):
        params = SamplingParams.from_dict({"max_new_tokens": 100})
        req = Req(
            0, [1], params, tokenizer=tokenizer, eos_token_ids=frozenset(),
            context_len=1000, heal=heal, context_free_decode=alone,
        )  # fmt: skip
        req.output_ids.extend(ids)
        texts.append(req.decoded_text())
    assert texts[0] == texts[1] == tokenizer.decode(ids)[len(first) :]


def _run(req: Req, ids: list[int], streamed: bool) -> list[str]:
    """Feed `ids` to `req` one token at a time, as the engine loop does (a streamed request
    takes its delta after each check), until it finishes or `ids` run out (then it ends
    by length); returns the streamed deltas (with the final one)."""
    deltas = []
    for token in ids:
        req.append_token(token)
        if req.is_finished:
            break
        if streamed:
            chunk = req.stream_delta()
            deltas.append(chunk["text"] if chunk else "")
    if not req.is_finished:
        req.finished_reason = {"type": "length", "length": len(req.output_ids)}
    req.finalize_text()
    if streamed:
        deltas.append(req.stream_delta()["text"])
    return deltas


def test_a_stop_string_ends_at_the_token_whose_bytes_complete_it(tokenizer, alone):
    """A token whose bytes end inside a character (`' ' + 2 of the euro sign's 3 bytes`)
    completes a stop string with its space: the output ends at that token, not at the
    next (it was held back whole). With min_new_tokens past it, the stop lies wholly in
    the text before them and does not count."""
    ids = tokenizer.encode("ab €cd", add_special_tokens=False)
    partial = next(i for i, t in enumerate(ids) if tokenizer.decode([t]).endswith("\ufffd"))
    assert tokenizer.decode(ids[: partial + 1]) == "ab \ufffd"  # (the space is in its token)
    req = _req(tokenizer, alone, stop=["b "])
    _run(req, ids, streamed=True)
    assert req.finished_reason == {"type": "stop", "matched": "b "}
    assert len(req.output_ids) == partial + 1 and req.text == "a"
    req = _req(tokenizer, alone, stop=["b "], min_new_tokens=partial + 2)
    _run(req, ids, streamed=False)
    assert req.finished_reason["type"] == "length" and req.text == "ab €cd"


def test_a_stop_only_a_trailing_incomplete_character_completes_cuts_nothing(tokenizer, alone):
    """An output that ends inside a UTF-8 sequence (by its length) ends in U+FFFD. The scan
    never sees that character, so no stop it completes ended the output: the final text
    keeps it, uncut (it was once cut there, with the finish reason still "length")."""
    ids = tokenizer.encode("ab 日本", add_special_tokens=False)
    ids = ids[: max(n for n in range(len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))]
    full = tokenizer.decode(ids)
    for params in ({"stop": [full]}, {"stop": ["\ufffd"]}, {"stop_regex": ["日."]}):
        quiet, streamed = _req(tokenizer, alone, **params), _req(tokenizer, alone, **params)
        _run(quiet, ids, streamed=False)
        deltas = _run(streamed, ids, streamed=True)
        assert quiet.finished_reason == {"type": "length", "length": len(ids)}, params
        assert quiet.text == streamed.text == "".join(deltas) == full, params


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streamed_text_adds_up_to_the_final_text_and_stops_as_unstreamed(tokenizer, alone, data):
    """Stop strings and a min_new_tokens, on text with multi-byte characters: a streamed
    request stops where an unstreamed one does, with the same text, and its deltas add up
    to that text (nothing streamed is taken back). A stop string counts only from the
    text of the min_new_tokens-th token on (one that ends in it included)."""
    ids = data.draw(_texts(tokenizer))
    stop_strings = ["a", "é", "b c", "日本", "ing", "\n.", "zzzz"]  # (the last: never there)
    stops = data.draw(st.lists(st.sampled_from(stop_strings), max_size=3))
    min_new = data.draw(st.integers(0, len(ids)))
    params = {"stop": stops, "min_new_tokens": min_new}
    quiet, streamed = _req(tokenizer, alone, **params), _req(tokenizer, alone, **params)
    _run(quiet, ids, streamed=False)
    deltas = _run(streamed, ids, streamed=True)
    assert streamed.finished_reason == quiet.finished_reason
    assert streamed.text == quiet.text == "".join(deltas)
    assert len(quiet.output_ids) >= min(min_new, len(ids))
    # Past FIND_EACH_MAX stop strings they are searched by length: the same stop.
    decoys = [f"z{i}" for i in range(FIND_EACH_MAX)]  # (never there)
    many = _req(tokenizer, alone, **{**params, "stop": stops + decoys})
    _run(many, ids, streamed=data.draw(st.booleans()))
    assert (many.finished_reason, many.text) == (quiet.finished_reason, quiet.text)
    # The text before the min_new_tokens-th token's is kept, but for where the stop string
    # that ended it may begin, ending in that token's text (and a character it does not
    # complete).
    before = tokenizer.decode(ids[: max(min_new - 1, 0)], skip_special_tokens=True)
    before = before.split("\ufffd")[0]
    matched = quiet.finished_reason.get("matched")
    overlap = len(matched) - 1 if isinstance(matched, str) else 0
    assert quiet.text.startswith(before[: max(0, len(before) - overlap)])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_byte_fallback_runs_stream_the_final_text(data):
    """A byte-fallback tokenizer decodes a run of byte pieces together, and one that is not
    valid UTF-8 as one U+FFFD per byte: a stray byte after a whole character changes that
    character's text too. The text grows only as a prefix of the full decode, and the
    streamed text adds up to the final one (it once streamed the character, then stopped)."""
    from helpers import byte_fallback_tokenizer

    from lmprog_runtime.byte_decode import byte_pieces

    tokenizer = byte_fallback_tokenizer()
    pieces = byte_pieces(tokenizer)
    assert len(pieces) == 256
    characters = st.sampled_from(["▁a", "▁ab", "b", "▁", "✅", "é", "日", "🙂"]).map(
        lambda text: tokenizer.encode(text.replace("▁", " "), add_special_tokens=False)
    )
    stray = (
        st.sampled_from([0xF0, 0xE2, 0x9C, 0x80])
        .map(lambda b: [f"<0x{b:02X}>"])
        .map(tokenizer.convert_tokens_to_ids)
    )
    parts = data.draw(st.lists(st.one_of(characters, stray), min_size=1, max_size=12))
    ids = [token for part in parts for token in part]
    quiet, streamed = (
        Req(
            0,
            [1],
            SamplingParams.from_dict({"max_new_tokens": 100}),
            tokenizer=tokenizer,
            eos_token_ids=frozenset(),
            context_len=1000,
            byte_pieces=pieces,
        )  # fmt: skip
        for _ in range(2)
    )
    for n in range(1, len(ids) + 1):
        quiet.output_ids.append(ids[n - 1])
        assert tokenizer.decode(ids[:n], skip_special_tokens=True).startswith(quiet.decoded_text())
    deltas = _run(streamed, ids, streamed=True)
    full = tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed.text == "".join(deltas) == full


@pytest.mark.parametrize("stop", [{"stop": ["u"]}, {"stop_regex": ["u"]}])
def test_a_stop_before_min_new_tokens_in_a_run_of_byte_pieces_does_not_count(stop):
    """A run of byte pieces across the min_new_tokens-th token ("u" then "[", one run): its
    text is read when a piece of another kind ends it, after that token, yet the "u" is
    the text of a token before it, and ends nothing (it ended the output)."""
    from helpers import byte_fallback_tokenizer

    from lmprog_runtime.byte_decode import byte_pieces

    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁a", "<0x75>", "<0x5B>", "b", "▁b"])
    params = {"max_new_tokens": 100, "min_new_tokens": 3, **stop}
    req = Req(
        0,
        [1],
        SamplingParams.from_dict(params),
        tokenizer=tokenizer,
        eos_token_ids=frozenset(),
        context_len=1000,
        byte_pieces=byte_pieces(tokenizer),
    )
    _run(req, ids, streamed=True)
    assert req.finished_reason["type"] == "length" and req.text == "au[b b"


@pytest.mark.parametrize("model", ["tiny", "instruct"])
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_engines_decode_is_the_tokenizers(model, data):
    """`Engine.decode` takes the Rust tokenizer's decode where the tokenizer's adds nothing
    to it (`backend_decode`): the same text as `tokenizer.decode`, special tokens skipped
    or kept, for the built-in tokenizer and the GGUF one."""
    tokenizer = _tokenizer_of(model)
    assert backend_decode(tokenizer) is not None  # (else this checks nothing new)
    special = sorted(tokenizer.all_special_ids)
    ids = data.draw(
        st.lists(st.integers(0, tokenizer.vocab_size - 1) | st.sampled_from(special), max_size=40)
    )
    decode = backend_decode(tokenizer)
    for skip in (True, False):
        assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(
            ids, skip_special_tokens=skip
        )


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer):
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert backend_decode(cleaning) is None
    assert backend_decode(object()) is None


@functools.cache
def _tokenizer_of(model: str):
    if model == "tiny":
        return AutoTokenizer.from_pretrained(default_model_path("tiny"))
    # (as the engine loads a GGUF's: the tokenizer.json built from its metadata)
    return PreTrainedTokenizerFast.from_pretrained(
        default_model_path("instruct"), local_files_only=True
    )


def test_the_engines_decode_of_a_batch_or_a_tensor_is_the_tokenizers(engine):
    """What `tokenizer.decode` takes besides one list of ids (a batch of lists, a tensor)
    goes to it, not to the Rust decode."""
    ids = engine.encode("Once upon a time")
    assert engine.decode([ids, ids[:2]]) == engine.tokenizer.decode([ids, ids[:2]])
    assert engine.decode(torch.tensor(ids)) == engine.tokenizer.decode(ids)
    assert engine.decode([]) == ""
