"""Sampling at ordinary settings against transformers' own logits warpers.

The reference is the first-token distribution of the same checkpoint under transformers:
its forward's logits through `TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper` and `MinPLogitsWarper`, in the order `generate` applies them (each
filter sees what the previous one kept, renormalised). The engine draws one token for
each of many seeds; every draw must be a token the reference allows, and the count of each
frequent token (and of the remaining allowed tokens together) must be within an exact
two-sided binomial tail of ALPHA around its reference probability.

False-positive rate: each of the at most 13 buckets of each of the 9 settings fails a
correct sampler with probability <= ALPHA = 1e-6, so the whole test fails one with
probability below 1.2e-4 for random seeds. The seeds are fixed, so a run is deterministic:
a pass stays a pass.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from helpers import PROMPTS
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

PROMPT = PROMPTS[1]  # its first token has several likely choices (top: .22, .15, .11, .08)
DRAWS = 600  # per setting; the slow tier draws more, to see smaller deviations
ALPHA = 1e-6  # two-sided tail probability at which one bucket's count is rejected
MIN_EXPECTED = 15  # a token gets its own bucket from this expected count on ...
MAX_BUCKETS = 12  # ... for the most likely ones; the other allowed tokens share one
SETTINGS = [
    {"temperature": 1.0},
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    # Top-p over what top-k kept: 3 tokens; over the full distribution it would keep 4.
    {"temperature": 0.7, "top_k": 5, "top_p": 0.8},
    {"temperature": 1.3, "top_k": 8, "min_p": 0.1},
    {"temperature": 0.7, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 6, "top_p": 0.7, "min_p": 0.15},
]


def reference_probs(logits: torch.Tensor, setting: dict) -> torch.Tensor:
    """transformers' sampling distribution for `setting` from next-token `logits` [vocab]."""
    warpers = [TemperatureLogitsWarper(setting["temperature"])]
    if setting.get("top_k", -1) > 0:
        warpers.append(TopKLogitsWarper(setting["top_k"]))
    if setting.get("top_p", 1.0) < 1.0:
        warpers.append(TopPLogitsWarper(setting["top_p"]))
    if setting.get("min_p", 0.0) > 0.0:
        warpers.append(MinPLogitsWarper(setting["min_p"]))
    no_ids = torch.zeros((1, 1), dtype=torch.long)  # the warpers above ignore the ids
    scores = LogitsProcessorList(warpers)(no_ids, logits[None].clone())
    return torch.softmax(scores[0], dim=-1)


def binomial_tail(n: int, p: float, k: int) -> float:
    """Two-sided exact tail: 2 * min(P(X <= k), P(X >= k)) for X ~ Binomial(n, p)."""
    if p <= 0.0 or p >= 1.0:
        return 1.0 if k == round(n * p) else 0.0
    log_pmf = [
        math.lgamma(n + 1)
        - math.lgamma(j + 1)
        - math.lgamma(n - j + 1)
        + j * math.log(p)
        + (n - j) * math.log1p(-p)
        for j in range(n + 1)
    ]
    pmf = [math.exp(x) for x in log_pmf]
    return min(1.0, 2 * min(sum(pmf[: k + 1]), sum(pmf[k:])))


@pytest.fixture(scope="module")
def first_token_logits(hf_tiny) -> torch.Tensor:
    model, tokenizer = hf_tiny
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(ids).logits[0, -1].float()


def stable_reference(logits: torch.Tensor, setting: dict) -> torch.Tensor:
    """`reference_probs`, after checking that logits moved by 1e-3 (ten times the engine's
    tolerance against transformers) allow exactly the same tokens: no filter cuts close to
    a token, so the engine's own logits must give the same allowed set."""
    probs = reference_probs(logits, setting)
    noise = torch.Generator().manual_seed(0)
    for _ in range(4):
        moved = logits + 1e-3 * torch.randn(logits.shape, generator=noise)
        assert torch.equal(reference_probs(moved, setting) > 0, probs > 0), setting
    return probs


@pytest.mark.parametrize("draws", [DRAWS, pytest.param(8 * DRAWS, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sampler", ["multinomial", "keyed"])
def test_sampled_first_tokens_follow_the_transformers_distribution(
    engine, first_token_logits, draws, sampler, monkeypatch
):
    """Every setting, in one batch (rows with different settings share forwards): draws
    stay inside the allowed set and each frequent token's count fits its probability. The
    settings allow from 3 tokens to the whole vocabulary, cut in different places. Both
    samplers: the CPU's (multinomial's draws) and the accelerators' (keyed races, run here
    on the CPU's logits)."""
    from lmprog_runtime import sampling

    if sampler == "keyed":
        monkeypatch.setattr(sampling, "on_accelerator", lambda device: True)
    ids = engine.encode(PROMPT)
    params = [
        {**SETTINGS[i % len(SETTINGS)], "max_new_tokens": 1, "seed": i}
        for i in range(draws * len(SETTINGS))
    ]
    chunk = DRAWS * len(SETTINGS)  # per call: the scheduler's work grows with its queue
    outs = []
    for start in range(0, len(params), chunk):
        part = params[start : start + chunk]
        outs += engine.generate(input_ids=[ids] * len(part), sampling_params=part)
    counts = [Counter() for _ in SETTINGS]
    for i, out in enumerate(outs):
        counts[i % len(SETTINGS)][out["output_ids"][0]] += 1
    references = [stable_reference(first_token_logits, s) for s in SETTINGS]
    assert len({int((probs > 0).sum()) for probs in references}) >= 6
    for setting, count, probs in zip(SETTINGS, counts, references):
        outside = {t: c for t, c in count.items() if probs[t] == 0}
        assert not outside, f"{setting}: drew tokens it does not allow: {outside}"
        likely = probs.argsort(descending=True)[:MAX_BUCKETS].tolist()
        buckets = [[t] for t in likely if probs[t] * draws >= MIN_EXPECTED]
        rest = sorted(set((probs > 0).nonzero().flatten().tolist()) - {b[0] for b in buckets})
        assert len(buckets) >= 3 and probs.max() < 0.6, setting
        for bucket in buckets + ([rest] if rest else []):
            p = float(probs[bucket].sum())
            k = sum(count[t] for t in bucket)
            tail = binomial_tail(draws, p, k)
            assert tail >= ALPHA, f"{setting}: tokens {bucket[:5]} drawn {k}x, p={p:.4f}"


def test_a_temperature_below_one_millionth_draws_greedily(engine):
    """As SGLang's: a temperature of 1e-38 once overflowed float32 in the division of the
    logits, and the draw failed the request."""
    params = {"max_new_tokens": 4, "seed": 0}
    greedy = engine.generate("Once upon a time", {**params, "temperature": 0})["output_ids"]
    for temperature in (1e-38, 1e-45, 5e-7):
        out = engine.generate("Once upon a time", {**params, "temperature": temperature})
        assert out["output_ids"] == greedy, temperature
