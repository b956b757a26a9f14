"""The grammar backend contract: compile a pattern once, match many requests against it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lmprog_runtime.transfer import to_device

# Output tokens jump-forward retokenizes at most (`Matcher.rollback`): a character's bytes
# (four in UTF-8) may each be one token.
MAX_REDONE = 4


class Matcher(ABC):
    """One request's position in a grammar."""

    @abstractmethod
    def fill_mask_words(self, words: torch.Tensor) -> None:
        """Write the tokens that may come next (EOS only where the text is complete) as bits
        into `words` (int32 [ceil(vocab / 32)], contiguous: bit `t % 32` of word `t // 32`)."""

    @abstractmethod
    def advance(self, token_id: int) -> None:
        """Follow a sampled token."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Go back `num_tokens` advances, at most `MAX_REDONE` (jump-forward retokenizes the
        last ones)."""

    @abstractmethod
    def is_complete(self) -> bool:
        """The text so far is a full match of the pattern."""

    @abstractmethod
    def accepts(self, token_ids: list[int]) -> bool:
        """Whether the matcher could follow `token_ids` from where it is now."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens that may come next."""
        return allowed_masks([self], vocab_size)[0]


class Grammar(ABC):
    """A compiled constraint; `regex` is the pattern it enforces (for jump-forward);
    `nbytes`, about how much memory it holds (the grammar cache's budget counts it)."""

    regex: str
    nbytes: int = 0

    @abstractmethod
    def new_matcher(self) -> Matcher: ...


class BaseGrammarBackend(ABC):
    @abstractmethod
    def compile_regex(self, regex: str) -> Grammar:
        """Raise ValueError for a pattern that is invalid or that the vocabulary cannot produce."""

    @abstractmethod
    def schema_to_regex(self, schema: str) -> str:
        """A JSON schema (as JSON text) to the regex of the documents it accepts."""

    def close(self) -> None:  # noqa: B027 - a backend with nothing to stop keeps it
        """Stop what compiles (the engine shuts down)."""


def word_allows(words: torch.Tensor, token_id: int) -> bool:
    """Whether mask words (`Matcher.fill_mask_words`' layout) allow `token_id`."""
    return bool((int(words[token_id // 32]) >> (token_id % 32)) & 1)


def allowed_masks(
    matchers: list[Matcher], vocab_size: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[len(matchers), vocab_size] bool on `device`: each matcher's allowed next tokens,
    written on the host as one bitmask tensor (a row per matcher; matchers write host
    memory), copied to `device` as bits (32x less than the mask) and unpacked there."""
    return unpack_mask_words(mask_words(matchers, vocab_size), vocab_size, device)


def mask_words(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """`allowed_masks`' host half: int32 [len(matchers), ceil(vocab_size / 32)] on the CPU,
    bit `t % 32` of word `t // 32` set where token t may come next."""
    shape = (len(matchers), (vocab_size + 31) // 32)
    words = torch.zeros(shape, dtype=torch.int32, device="cpu")
    for matcher, row in zip(matchers, words):
        matcher.fill_mask_words(row)
    return words


def unpack_mask_words(
    words: torch.Tensor, vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """`allowed_masks`' device half: `mask_words`' rows as bool [n, vocab_size] on `device`."""
    words = to_device(words, device)
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()
