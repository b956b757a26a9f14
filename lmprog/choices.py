"""How `select` turns per-token log-probabilities of each choice into a decision.

Each method receives, per choice, the log-probabilities of the choice's tokens given the
prompt (and, for `unconditional_likelihood_normalized`, given no prompt) and returns the
index of the winner plus the scores it compared (`decide`). A method written for SGLang
works too: a subclass that implements `__call__(*, choices, normalized_prompt_logprobs,
input_token_logprobs, output_token_logprobs, unconditional_token_logprobs)` and returns a
`ChoicesDecision` (its `meta_info` becomes the select's), and the built-in methods can be
called that way.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, NamedTuple

TIE_TOLERANCE = 1e-5


class ChoiceDecision(NamedTuple):
    """`decide`'s answer: the winner's index and the scores compared."""

    index: int
    scores: list[float]


@dataclass
class ChoicesDecision:
    """SGLang's decision: the chosen text and the select's meta info."""

    decision: str
    meta_info: dict[str, Any] | None = None


class ChoicesSamplingMethod:
    """Base: implement `decide(token_logprobs, unconditional)` -> ChoiceDecision, or SGLang's
    `__call__(*, choices, normalized_prompt_logprobs, input_token_logprobs,
    output_token_logprobs, unconditional_token_logprobs=None)` -> ChoicesDecision. Set
    `needs_unconditional` (or SGLang's `requires_unconditional_logprobs` property) for a
    method that compares against the choices' logprobs given no prompt."""

    name = "base"
    needs_unconditional = False

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return self.needs_unconditional

    @property
    def label(self) -> str:
        """`name`, or a subclass's class name where it sets none."""
        return self.name if self.name != "base" else type(self).__name__

    def decide(
        self,
        token_logprobs: list[list[float]],
        unconditional: list[list[float]] | None = None,
        *,
        normalized: list[float] | None = None,
    ) -> ChoiceDecision:
        """`normalized`: each choice's mean token logprob, where the caller has it."""
        raise NotImplementedError(
            f"{type(self).__name__} must implement decide(token_logprobs, unconditional) "
            "or SGLang's __call__(*, choices, normalized_prompt_logprobs, "
            "input_token_logprobs, output_token_logprobs, unconditional_token_logprobs)"
        )

    def extra_meta(
        self,
        token_logprobs: list[list[float]],
        unconditional: list[list[float]] | None,
        decision: ChoiceDecision,
    ) -> dict[str, Any]:
        """What the select's meta info gets besides the common keys (SGLang's names)."""
        return {}

    def __call__(
        self,
        *,
        choices: list[str],
        normalized_prompt_logprobs: list[float],
        input_token_logprobs: list[list[Any]],
        output_token_logprobs: list[list[Any]],
        unconditional_token_logprobs: list[list[Any]] | None = None,
    ) -> ChoicesDecision:
        """SGLang's interface over `decide`: entries are `(logprob, token_id, text)`."""
        unconditional = None
        if unconditional_token_logprobs is not None:
            unconditional = [_values(entries) for entries in unconditional_token_logprobs]
        token_logprobs = [_values(e) for e in input_token_logprobs]
        if "normalized" in inspect.signature(self.decide).parameters:
            decision = self.decide(
                token_logprobs, unconditional, normalized=normalized_prompt_logprobs
            )
        else:  # (a subclass's decide without it)
            decision = self.decide(token_logprobs, unconditional)
        meta = {
            "normalized_prompt_logprobs": normalized_prompt_logprobs,
            "input_token_logprobs": input_token_logprobs,
            "output_token_logprobs": output_token_logprobs,
            "scores": decision.scores,
            **self.extra_meta(token_logprobs, unconditional, decision),
        }
        if unconditional_token_logprobs is not None:
            meta["unconditional_token_logprobs"] = unconditional_token_logprobs
        return ChoicesDecision(choices[decision.index], meta)

    @property
    def is_sglang_style(self) -> bool:
        """A subclass with its own `__call__` (written for SGLang)."""
        return type(self).__call__ is not ChoicesSamplingMethod.__call__

    def __repr__(self) -> str:
        return self.label


def _values(entries: list[Any]) -> list[float]:
    """The logprobs of `(logprob, token_id, ...)` entries (a leading None counts as 0)."""
    return [0.0 if entry[0] is None else entry[0] for entry in entries]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _padded(token_logprobs: list[list[float]]) -> list[list[float]]:
    """Each choice's token logprobs padded to the longest with its own mean."""
    width = max(len(lps) for lps in token_logprobs)
    return [lps + [_mean(lps)] * (width - len(lps)) for lps in token_logprobs]


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: scores[i])


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest average token log-probability."""

    name = "token_length_normalized"

    def decide(self, token_logprobs, unconditional=None, *, normalized=None):
        scores = [_mean(lps) for lps in token_logprobs] if normalized is None else normalized
        return ChoiceDecision(_argmax(scores), list(scores))


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best log-probability at each
    position; a choice shorter than the others is padded with its own average."""

    name = "greedy_token_selection"

    def decide(self, token_logprobs, unconditional=None, *, normalized=None):
        padded = _padded(token_logprobs)
        width = len(padded[0])
        alive = list(range(len(padded)))
        for j in range(width):
            best = max(padded[i][j] for i in alive)
            # Shared leading tokens score the same up to float noise across requests.
            alive = [i for i in alive if padded[i][j] >= best - TIE_TOLERANCE]
            if len(alive) == 1:
                break
        scores = [_mean(lps) for lps in token_logprobs]
        return ChoiceDecision(alive[0], scores)

    def extra_meta(self, token_logprobs, unconditional, decision):
        return {"greedy_logprob_matrix": _padded(token_logprobs)}


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest average of (log p(token | prompt) - log p(token | no prompt)): corrects
    for choices that are likely whatever the question. As in SGLang, the unconditional
    logprobs are those of the choice's tokens alone, the first (None) counting 0."""

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def decide(self, token_logprobs, unconditional=None, *, normalized=None):
        if unconditional is None:
            raise ValueError(f"{self.name} needs the choices' unconditional logprobs")
        scores = [
            _mean([a - b for a, b in zip(cond, uncond)])
            for cond, uncond in zip(token_logprobs, unconditional)
        ]
        return ChoiceDecision(_argmax(scores), scores)

    def extra_meta(self, token_logprobs, unconditional, decision):
        return {"normalized_unconditional_prompt_logprobs": decision.scores}


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
