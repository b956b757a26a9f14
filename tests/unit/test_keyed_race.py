"""Keyed draws (`keyed_race.py`, the accelerator's sampler) against their definition: the
noise is Exp(1), draws follow the probabilities (exact binomial tails, as in
test_sampling.py), consecutive draws of one request are independent, and a row depends on
its own key and probabilities only. The Triton kernel's equality with the torch ops is in
tests/kernels/test_triton_race.py.

False-positive rate: 21 counts are each rejected at ALPHA = 1e-6, so a correct sampler
fails with probability below 2.1e-5 for random keys; the keys are fixed, so a run is
deterministic.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.keyed_race import key_words, keyed_exponentials, keyed_race, race_key
from lmprog_runtime.sampling import SampleRow, sample_token_ids
from lmprog_runtime.sampling_params import SamplingParams

ALPHA = 1e-6  # two-sided tail probability at which a count is rejected


def binomial_tail(n: int, p: float, k: int) -> float:
    """Two-sided exact tail 2 * min(P(X <= k), P(X >= k)), X ~ Binomial(n, p): the pmf
    summed from k outwards, in logs, until its terms no longer change the sum."""

    def log_pmf(j: int) -> float:
        return (
            math.lgamma(n + 1)
            - math.lgamma(j + 1)
            - math.lgamma(n - j + 1)
            + j * math.log(p)
            + (n - j) * math.log1p(-p)
        )

    def tail(step: int) -> float:
        total, j = 0.0, k
        while 0 <= j <= n:
            term = math.exp(log_pmf(j))
            total += term
            if term < 1e-18 * total and abs(j - k) > 3:
                break
            j += step
        return total

    return min(1.0, 2 * min(tail(-1), tail(+1)))


def test_keys_differ_by_seed_and_draw_and_fit_64_bits():
    keys = {race_key(seed, draws) for seed in (-1, 0, 1, 2**40, 2**63 - 1) for draws in range(50)}
    assert len(keys) == 250
    assert all(0 <= key < 2**64 for key in keys)
    assert race_key(-1, 3) == race_key(2**64 - 1, 3)  # seeds are taken modulo 2^64


def test_noise_is_exponential():
    """P(e > t) = exp(-t) at several t, over 64 keys x 4096 tokens; every value finite and
    positive (a zero would turn a zero-probability token into 0 / 0)."""
    noise = keyed_exponentials(key_words([race_key(s, 0) for s in range(64)], "cpu"), 4096)
    assert noise.dtype == torch.float32 and bool(torch.isfinite(noise).all())
    assert float(noise.min()) > 0
    n = noise.numel()
    for t in (0.05, 0.3, 1.0, 2.0, 4.0):
        k = int((noise > t).sum())
        assert binomial_tail(n, math.exp(-t), k) >= ALPHA, t


PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04] + [0.0] * 250)


@pytest.mark.parametrize("keys", ["seeds", "draws"])
def test_draws_follow_the_probabilities(keys):
    """Many requests' first draws (one key per seed), and one request's successive draws
    (one key per draw number): each token's count fits its probability, nothing outside
    the support is drawn."""
    n = 6000
    if keys == "seeds":
        key_list = [race_key(seed, 0) for seed in range(n)]
    else:
        key_list = [race_key(7, draws) for draws in range(n)]
    tokens = keyed_race(PROBS.expand(n, -1).contiguous(), key_list).tolist()
    counts = Counter(tokens)
    assert set(counts) <= set(range(6))
    for token in range(6):
        assert binomial_tail(n, float(PROBS[token]), counts[token]) >= ALPHA, (token, counts)


def test_successive_draws_are_independent():
    """One request's draw d and draw d + 1 from a fair coin: the four pairs each a quarter."""
    n = 8000
    coin = torch.tensor([[1.0, 1.0]]).expand(n + 1, -1).contiguous()
    tokens = keyed_race(coin, [race_key(11, d) for d in range(n + 1)]).tolist()
    pairs = Counter(zip(tokens, tokens[1:]))
    for pair in ((0, 0), (0, 1), (1, 0), (1, 1)):
        assert binomial_tail(n, 0.25, pairs[pair]) >= ALPHA, pairs


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.sampled_from([1, 5, 300, 2049]), seed=st.integers(0, 99))
def test_a_row_draws_the_same_alone_and_in_a_batch(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=gen), dim=-1)
    probs[probs < probs.median()] = 0  # rows cut as top-k / top-p leave them
    keys = [race_key(seed + i, i) for i in range(rows)]
    batch = keyed_race(probs, keys).tolist()
    assert batch == [int(keyed_race(probs[i : i + 1], keys[i : i + 1])[0]) for i in range(rows)]
    assert all(float(probs[i, t]) > 0 for i, t in enumerate(batch))


def test_keys_must_match_the_rows():
    with pytest.raises(ValueError, match="keys has 1 entries for 2 rows"):
        keyed_race(torch.ones(2, 3), [race_key(0, 0)])


def test_sampling_off_the_cpu_races_by_key(monkeypatch):
    """`sample_token_ids` where draws are keyed: each sampled row is `keyed_race` of its
    filtered distribution with its own key; greedy rows take the argmax; no generator is
    touched."""
    from lmprog_runtime import sampling

    monkeypatch.setattr(sampling, "on_accelerator", lambda device: True)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(5))
    sampled = SamplingParams(temperature=1.0, top_k=4)
    greedy = SamplingParams(temperature=0)
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    states = [g.get_state() for g in generators]
    keys = [race_key(1, 0), 0, race_key(2, 9)]
    rows = [
        SampleRow(0, sampled, generators[0], keys[0], None, [], None),
        SampleRow(1, greedy, generators[1], keys[1], None, [], None),
        SampleRow(2, sampled, generators[2], keys[2], None, [], None),
    ]
    got = sample_token_ids(logits, rows).tolist()
    top4 = logits.topk(4, dim=-1)
    probs = torch.zeros_like(logits).scatter_(1, top4.indices, torch.softmax(top4.values, -1))
    want = keyed_race(probs[[0, 2]], [keys[0], keys[2]]).tolist()
    assert got == [want[0], int(logits[1].argmax()), want[1]]
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators, states))
