"""Grammar backend on outlines-core: a token index per regex over the model's vocabulary.

The vocabulary is handed to outlines-core as the bytes each token stands for: byte-level
BPE tokens are mapped back through the GPT-2 byte-to-unicode table, byte-fallback tokens
(`<0x0A>`) to their byte, SentencePiece's `▁` to a space. Special tokens are left out,
except EOS, which the index allows only where the text is a complete match. Each regex
reaches it as `portable_regex` writes it again, so that it reads it as Python's `re` does.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from lmprog_runtime.byte_decode import unicode_to_byte
from lmprog_runtime.constrained.base import MAX_REDONE, BaseGrammarBackend, Grammar, Matcher
from lmprog_runtime.constrained.index_process import IndexCompiler
from lmprog_runtime.constrained.json_schema import schema_to_regex
from lmprog_runtime.constrained.portable_regex import portable_regex

# An index holds about twice its pickle's size in memory (over SmolLM2's vocabulary, ten
# indexes of `[^\n]{1,150}` pickled to 80 MiB each and took 170 MiB each of RSS).
HELD_PER_PICKLED_BYTE = 2
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def token_bytes(tokenizer: Any) -> dict[int, bytes]:
    """token id -> the bytes it decodes to, for every ordinary (non-special) token. Special
    tokens include those marked special only among the added tokens (a tokenizer need not
    list them in `all_special_ids`): a decode that skips them would lose their text."""
    special = set(tokenizer.all_special_ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special |= {token_id for token_id, token in added.items() if token.special}
    vocab = tokenizer.get_vocab()
    byte_level = is_byte_level(tokenizer)
    table = unicode_to_byte() if byte_level else None
    out = {}
    for piece, token_id in vocab.items():
        if token_id in special:
            continue
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback:
            out[token_id] = bytes([int(fallback.group(1), 16)])
        elif table is not None:
            if all(ch in table for ch in piece):
                out[token_id] = bytes(table[ch] for ch in piece)
        else:
            out[token_id] = piece.replace("\u2581", " ").encode("utf-8")
    return out


def is_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    return "ByteLevel" in str(backend.pre_tokenizer) or "ByteLevel" in str(backend.decoder)


class _OutlinesMatcher(Matcher):
    def __init__(self, guide: Any) -> None:
        self._guide = guide

    def fill_mask_words(self, words: torch.Tensor) -> None:
        assert words.dtype == torch.int32 and words.is_contiguous()
        self._guide.write_mask_into(words.data_ptr(), words.numel(), 4)

    def advance(self, token_id: int) -> None:
        self._guide.advance(token_id, return_tokens=False)

    def is_complete(self) -> bool:
        return bool(self._guide.is_finished())

    def accepts(self, token_ids: list[int]) -> bool:
        return bool(self._guide.accepts_tokens(token_ids))

    def rollback(self, num_tokens: int) -> None:
        self._guide.rollback_state(num_tokens)


class _OutlinesGrammar(Grammar):
    def __init__(self, index: Any, regex: str, nbytes: int) -> None:
        self._index = index
        self.regex = regex
        self.nbytes = nbytes

    def new_matcher(self) -> Matcher:
        from outlines_core import Guide

        # Jump-forward retokenizes the last sampled tokens: those of the last character.
        return _OutlinesMatcher(Guide(self._index, max_rollback=MAX_REDONE))


class OutlinesGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, eos_token_id: int) -> None:
        from outlines_core import Vocabulary

        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in token_bytes(tokenizer).items():
            by_bytes.setdefault(data, []).append(token_id)
        self._vocabulary = Vocabulary(eos_token_id, by_bytes)
        self._indexes = IndexCompiler(self._vocabulary)  # (in child processes: stoppable)

    def compile_regex(self, regex: str) -> Grammar:
        try:
            portable = engine_regex(regex)
        except ValueError as error:
            raise ValueError(f"cannot compile regex {regex!r}: {error}") from None
        try:
            index, pickled = self._indexes.compile(portable)
            return _OutlinesGrammar(index, regex, HELD_PER_PICKLED_BYTE * pickled)
        except ValueError as error:  # (what outlines-core refused; a lost child: RuntimeError)
            if "following characters: []" in str(error):  # (its "vocabulary" message)
                raise ValueError(
                    f"cannot compile regex {regex!r}: no text matches it (a character class "
                    "in it takes no character, as [^\\s\\S] does)"
                ) from None
            raise ValueError(f"cannot compile regex {regex!r}: {error}") from error

    def schema_to_regex(self, schema: str) -> str:
        return schema_to_regex(schema)

    def close(self) -> None:
        self._indexes.close()


def engine_regex(regex: str) -> str:
    """`regex` as outlines-core is given it (`portable_regex`); ValueError naming why it
    is refused for what it says: Rust's class syntax (`rust_only_class_syntax`), or what
    `portable_regex` cannot write. (The compile and the frontend's check both ask here.)"""
    dialect = rust_only_class_syntax(regex)
    if dialect is not None:
        raise ValueError(
            f"{dialect!r} in a character class is Rust's syntax (a nested class, a POSIX "
            "class or a set operation), which Python's re reads otherwise, so outputs would "
            "not re.fullmatch it; write the class out (escape a literal '[' as '\\[')"
        )
    return portable_regex(regex)


def rust_only_class_syntax(regex: str) -> str | None:
    """The first piece of a character class that outlines-core's regex engine (Rust) reads
    as a nested class or a set operation (`[[:digit:]]`, `[a-z&&[^b]]`, `[\\d--5]`) where
    Python's `re` reads literal characters; None if there is none."""
    depth, i = 0, 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if depth == 0:
            if ch == "[":
                depth, i = 1, i + 1
                i += regex.startswith("^", i)  # (a class's first ']' is a literal)
                i += regex.startswith("]", i)
                continue
        elif ch == "]":
            depth = 0
        elif ch == "[" or regex[i : i + 2] in ("&&", "--", "~~"):
            return regex[i : i + 2]
        i += 1
    return None
