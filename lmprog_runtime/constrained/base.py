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
