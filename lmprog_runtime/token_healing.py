"""Token healing: a prompt that ends where the model would not end a token.

A program that writes "Name: " before a gen ends its prompt in a lone space token. The
model almost never saw a space token before a word (it writes " Sir" as one token), so it
answers "\\n" or nothing. Healing (guidance's name for it) backs the prompt's last token up
and lets the first generated token be any token that begins with that token's text: the
model then writes " Sir" itself. The request's text starts after the backed-up text, so
prompt + text reads as before.

Unconstrained, the first draw is masked like a grammar's (`HealMatcher`, through the
sampler's mask path); the tokens that extend a token are found by a binary search over the
vocabulary's bytes, sorted once per engine. A constrained request's pattern gets the
backed-up text in front (`healed_pattern`): its grammar then allows the first tokens that
spell that text and go on into the pattern, as guidance's grammars heal. The text is
decoded with a few prompt tokens before the backed-up one as context (`Heal.context`), so
a SentencePiece word's leading space comes out as in the prompt.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import torch

from lmprog_runtime.constrained.base import Matcher, word_allows
from lmprog_runtime.constrained.outlines_backend import token_bytes
from lmprog_runtime.constrained.portable_regex import (
    nests_as_written,
    portable_regex,
    without_edge_anchors,
)

# Prompt tokens an output is decoded after: those before a backed-up token, or
# (`Engine._detok_context`) the prompt's last ones.
CONTEXT_TOKENS = 4
# Extension masks kept, the ones used last: a mask is a bit a token (6 KiB over SmolLM2's
# 49k tokens, 18k of which other tokens extend: 105 MiB held once all were asked for, and
# more over larger vocabularies).
MAX_MASKS = 2048


class Heal(NamedTuple):
    """A prompt's healing: its last token is backed up and regenerated."""

    token_id: int  # the backed-up token
    text: str  # its text, as it reads after `context`
    context: list[int]  # the prompt tokens before it (at most CONTEXT_TOKENS)
    cut: int  # len(decode(context + [token_id])): the output's text starts after it
    words: torch.Tensor  # int32 mask words: the tokens whose bytes begin with its bytes


class TokenHealer:
    """Plans the healing of prompts for one engine (any thread). It holds the engine's
    tokenizer and the lock its calls take, never the engine (which must stay collectable
    by reference counting: `test_engine_lifetime.py`)."""

    def __init__(self, tokenizer: Any, tokenizer_lock: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._tokenizer_lock = tokenizer_lock
        self._vocab_size = vocab_size
        self._lock = threading.Lock()
        self._keys: list[bytes] | None = None  # every ordinary token's bytes, sorted
        self._ids: list[int] = []  # the token of each key
        self._bytes: dict[int, bytes] = {}
        # token -> its extensions' words, the `MAX_MASKS` used last
        self._words: OrderedDict[int, torch.Tensor | None] = OrderedDict()

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        with self._tokenizer_lock:
            return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def plan(self, input_ids: list[int], skip_special_tokens: bool) -> Heal | None:
        """How to heal `input_ids`, or None where there is nothing to heal: a prompt of one
        token, a special last token, one that no other token extends, or one whose text is
        not whole characters."""
        if len(input_ids) < 2:
            return None
        token = input_ids[-1]
        words = self.extensions(token)
        if words is None:
            return None
        context = input_ids[max(0, len(input_ids) - 1 - CONTEXT_TOKENS) : -1]
        before = self._decode(context, skip_special_tokens)
        after = self._decode([*context, token], skip_special_tokens)
        text = after[len(before) :]
        # The mask and a healed pattern read the token's bytes: heal only where its text in
        # context is those bytes (a SentencePiece word first in the text decodes without
        # its space).
        if not after.startswith(before) or text.encode() != self._bytes.get(token):
            return None
        return Heal(token, text, context, len(after), words)

    def extensions(self, token_id: int) -> torch.Tensor | None:
        """int32 mask words of the tokens whose bytes begin with `token_id`'s (itself
        included); None if it is special or no other token extends it."""
        with self._lock:
            if token_id in self._words:
                self._words.move_to_end(token_id)
                return self._words[token_id]
            words = self._words[token_id] = self._find_extensions(token_id)
            if len(self._words) > MAX_MASKS:
                self._words.popitem(last=False)
            return words

    def _find_extensions(self, token_id: int) -> torch.Tensor | None:
        if self._keys is None:
            with self._tokenizer_lock:  # (special tokens left out: a decode skips them)
                table = token_bytes(self._tokenizer)
            self._bytes = {tid: data for tid, data in table.items() if data}
            pairs = sorted((data, tid) for tid, data in self._bytes.items())
            self._keys = [data for data, _ in pairs]
            self._ids = [tid for _, tid in pairs]
        prefix = self._bytes.get(token_id)
        if not prefix:
            return None
        # The keys that begin with `prefix` sort together, from the first key >= it.
        start = end = bisect.bisect_left(self._keys, prefix)
        while end < len(self._keys) and self._keys[end].startswith(prefix):
            end += 1
        ids = np.array([t for t in self._ids[start:end] if t < self._vocab_size], dtype=np.int64)
        if len(ids) < 2:
            return None
        words = np.zeros((self._vocab_size + 31) // 32, dtype=np.uint32)
        np.bitwise_or.at(words, ids // 32, np.left_shift(1, ids % 32).astype(np.uint32))
        return torch.from_numpy(words.view(np.int32))


def healed_pattern(text: str, regex: str) -> str:
    """`regex` with the literal `text` in front: ASCII other than letters and digits as
    `\\xHH` escapes (read alike by outlines-core and Python's `re`), other characters as
    themselves (none of them is special in a regex). Anchors and global flags belong to the
    gen's own output: a `regex` with them (`^\\d+$`, `(?i)yes`) goes in without its edge
    anchors, or as `portable_regex` writes it (with neither) where that is not enough. The
    rest go in as written: jump-forward reads them as Python's `re` does, and the portable
    form is outlines-core's."""
    literal = "".join(
        ch if ch.isalnum() or not ch.isascii() else f"\\x{ord(ch):02x}" for ch in text
    )
    if not nests_as_written(regex):
        regex = without_edge_anchors(regex)
    if not nests_as_written(regex):
        with contextlib.suppress(ValueError):  # (the compile refuses it again, naming why)
            regex = portable_regex(regex)
    return f"{literal}(?:{regex})"


class HealMatcher(Matcher):
    """Masks a healed request's first draw to the backed-up token's extensions; allows
    every token after it (the request then drops it: `Req.check_last_token`)."""

    def __init__(self, words: torch.Tensor) -> None:
        self._words = words
        self._drawn = 0

    def fill_mask_words(self, words: torch.Tensor) -> None:
        if self._drawn:
            words.fill_(-1)
        else:
            words.copy_(self._words)

    def advance(self, token_id: int) -> None:
        self._drawn += 1

    def rollback(self, num_tokens: int) -> None:
        self._drawn = max(0, self._drawn - num_tokens)

    def is_complete(self) -> bool:
        return True  # healing constrains one token, never where the text may end

    def accepts(self, token_ids: list[int]) -> bool:
        if self._drawn or not token_ids:
            return True
        return word_allows(self._words, token_ids[0])
