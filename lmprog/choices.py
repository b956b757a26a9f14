"""How `select` turns per-token log-probabilities of each choice into a decision.

Each method receives, per choice, the log-probabilities of the choice's tokens given the
prompt (and, for `unconditional_likelihood_normalized`, given no prompt) and returns the
index of the winner plus the scores it compared.
"""

from __future__ import annotations

from typing import NamedTuple

TIE_TOLERANCE = 1e-5


class ChoiceDecision(NamedTuple):
    index: int
    scores: list[float]


class ChoicesSamplingMethod:
    """Base: `decide(token_logprobs, unconditional_logprobs)` -> ChoiceDecision."""

    name = "base"
    needs_unconditional = False

    def decide(
        self, token_logprobs: list[list[float]], unconditional: list[list[float]] | None = None
    ) -> ChoiceDecision:
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("-inf")


def _argmax(scores: list[float]) -> int:
    return max(range(len(scores)), key=lambda i: scores[i])


class TokenLengthNormalized(ChoicesSamplingMethod):
    """The choice with the highest average token log-probability."""

    name = "token_length_normalized"

    def decide(self, token_logprobs, unconditional=None):
        scores = [_mean(lps) for lps in token_logprobs]
        return ChoiceDecision(_argmax(scores), scores)


class GreedyTokenSelection(ChoicesSamplingMethod):
    """Compare choices token by token, keeping those with the best log-probability at each
    position; a choice shorter than the others is padded with its own average."""

    name = "greedy_token_selection"

    def decide(self, token_logprobs, unconditional=None):
        width = max(len(lps) for lps in token_logprobs)
        padded = [lps + [_mean(lps)] * (width - len(lps)) for lps in token_logprobs]
        alive = list(range(len(padded)))
        for j in range(width):
            best = max(padded[i][j] for i in alive)
            # Shared leading tokens score the same up to float noise across requests.
            alive = [i for i in alive if padded[i][j] >= best - TIE_TOLERANCE]
            if len(alive) == 1:
                break
        scores = [_mean(lps) for lps in token_logprobs]
        return ChoiceDecision(alive[0], scores)


class UnconditionalLikelihoodNormalized(ChoicesSamplingMethod):
    """The highest average of (log p(token | prompt) - log p(token | no prompt)): corrects
    for choices that are likely whatever the question."""

    name = "unconditional_likelihood_normalized"
    needs_unconditional = True

    def decide(self, token_logprobs, unconditional=None):
        assert unconditional is not None
        scores = [
            _mean([a - b for a, b in zip(cond, uncond)])
            for cond, uncond in zip(token_logprobs, unconditional)
        ]
        return ChoiceDecision(_argmax(scores), scores)


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()
