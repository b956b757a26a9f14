"""The grammar backend contract: compile a pattern once, match many requests against it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Matcher(ABC):
    """One request's position in a grammar."""

    @abstractmethod
    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: tokens that may come next (EOS only where the text is complete)."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Follow a sampled token."""

    @abstractmethod
    def is_complete(self) -> bool:
        """The text so far is a full match of the pattern."""

    @abstractmethod
    def accepts(self, token_ids: list[int]) -> bool:
        """Whether the matcher could follow `token_ids` from where it is now."""

    def fill_mask_words(self, words: torch.Tensor) -> bool:
        """Write the allowed tokens as bits into `words` (int32 [ceil(vocab / 32)], bit
        `t % 32` of word `t // 32`); False if this matcher cannot (then `allowed_mask`)."""
        return False

    def rollback(self, num_tokens: int) -> bool:
        """Go back `num_tokens` advances; False (and nothing changes) if it cannot."""
        return False


class Grammar(ABC):
    """A compiled constraint; `regex` is the pattern it enforces (for jump-forward)."""

    regex: str

    @abstractmethod
    def new_matcher(self) -> Matcher: ...


class BaseGrammarBackend(ABC):
    @abstractmethod
    def compile_regex(self, regex: str) -> Grammar:
        """Raise ValueError for a pattern that is invalid or that the vocabulary cannot produce."""

    @abstractmethod
    def schema_to_regex(self, schema: str) -> str:
        """A JSON schema (as JSON text) to the regex of the documents it accepts."""


def allowed_masks(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool: each matcher's allowed next tokens, written as one
    bitmask tensor (a row per matcher) and unpacked in one operation."""
    num_words = (vocab_size + 31) // 32
    words = torch.zeros((len(matchers), num_words), dtype=torch.int32)
    fallback = [j for j, m in enumerate(matchers) if not m.fill_mask_words(words[j])]
    bits = (words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.reshape(len(matchers), -1)[:, :vocab_size].bool()
    for j in fallback:
        allowed[j] = matchers[j].allowed_mask(vocab_size)
    return allowed
