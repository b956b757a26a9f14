"""The batched draw is torch.multinomial, row by row: same tokens, same generator states.

`sampling.draw` replaces one `torch.multinomial(probs[i], 1, generator=g_i)` call per row
with one uniform draw per row and a batched race (issue 14). Seeded requests must sample
exactly what they sampled before, whatever shares their batch; the reference here is
multinomial itself.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.penalties import PenaltyCounts, PenaltyRow
from lmprog_runtime.sampling import (
    SampleRow,
    _exponential_race,
    _race_matches_multinomial,
    argmax_rows,
    draw,
    sample_each,
    sample_token_ids,
)
from lmprog_runtime.sampling_filters import top_k_top_p, top_k_top_p_unsorted
from lmprog_runtime.sampling_params import SamplingParams


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([1, 2, 17, 1000, 4099]),
    keep=st.sampled_from([None, 1, 3, 50]),
    scale=st.floats(0.1, 8.0),
    seed=st.integers(0, 2**31),
)
def test_draw_equals_multinomial_row_by_row(rows, vocab, keep, scale, seed):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale
    probs = torch.softmax(logits, dim=-1)
    if keep is not None and keep < vocab:  # a top-k filter: zeros outside the top `keep`
        cut = probs.topk(keep, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < cut, 0.0)
    seeds = [seed + i for i in range(rows)]
    ours = [torch.Generator().manual_seed(s) for s in seeds]
    theirs = [torch.Generator().manual_seed(s) for s in seeds]
    for _ in range(3):  # consecutive steps: the generators must stay in step too
        drawn = draw(probs, ours, list(range(rows))).tolist()
        expected = [int(torch.multinomial(p, 1, generator=g)[0]) for p, g in zip(probs, theirs)]
        assert drawn == expected
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(ours, theirs))


def test_this_torch_takes_the_batched_path():
    """The fallback (multinomial per row) exists for other torch builds; this one races."""
    assert _race_matches_multinomial()
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    assert _exponential_race(probs, generators).tolist()[0] == 1


@pytest.mark.parametrize(
    "bad", [float("nan"), float("inf"), -1.0, "zero"], ids=["nan", "inf", "negative", "zero"]
)
def test_a_row_without_finite_positive_mass_names_its_request(bad):
    probs = torch.full((3, 5), 0.2)
    probs[1] = 0.0 if bad == "zero" else probs[1]
    if bad != "zero":
        probs[1, 2] = bad
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    with pytest.raises(ValueError, match="request 41"):
        draw(probs, generators, [40, 41, 42])


def _reference_top_k_top_p(probs, top_k, top_p):
    """Sort each row in full: keep its top-k, then the smallest prefix of them whose share
    of their mass (the row's, without a top-k) reaches top_p."""
    out = torch.zeros_like(probs)
    vocab = probs.shape[-1]
    for i, row in enumerate(probs):
        values, index = row.sort(descending=True)
        k = int(top_k[i])
        values[k:] = 0.0
        mass = values.sum() if k < vocab else row.sum()
        share_before = (values.cumsum(0) - values) / mass
        if top_p[i] < 1.0:
            values[share_before >= top_p[i]] = 0.0
        out[i, index] = values
    return out


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([8, 300, 5000]),
    top_k=st.sampled_from([1, 5, 40, 400, 0]),
    top_p=st.sampled_from([0.1, 0.5, 0.9, 0.999, 1.0]),
    flat=st.sampled_from([0.05, 1.0, 6.0]),
    seed=st.integers(0, 2**31),
)
def test_windowed_top_k_top_p_keeps_what_a_full_sort_keeps(vocab, top_k, top_p, flat, seed):
    """Only a window of each row is sorted, unless its cut lies beyond (flat rows)."""
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(seed)) * flat
    probs = torch.softmax(logits, dim=-1)
    k = torch.full((3,), top_k if 0 < top_k <= vocab else vocab)
    p = torch.full((3,), top_p)
    if top_p == 1.0 and k[0] == vocab:
        return  # nothing to filter: the caller skips such rows
    expected = _reference_top_k_top_p(probs, k, p)
    assert torch.equal(top_k_top_p(probs, k, p), expected)
    assert torch.equal(top_k_top_p(probs, k, p, full=True), expected)  # (the GPU's way)


def _reference_kept_with_ties(counts: list[int], top_k: int, top_p: float) -> list[bool]:
    """Which tokens of a row of probabilities `counts[i] / 4096` (exact) top-k and top-p
    keep, ties at a cut all kept: top-k keeps those at least as likely as the k-th, top-p
    those whose strictly more likely kept tokens hold less than top_p of the kept mass
    (that product rounded to float32, as the sampler computes it)."""
    vocab = len(counts)
    kth = sorted(counts, reverse=True)[top_k - 1] if top_k < vocab else 0
    kept = [c >= kth for c in counts]
    if top_p >= 1.0:
        return kept
    mass = sum(c for c, k in zip(counts, kept) if k) / 4096
    target = float(torch.tensor(top_p, dtype=torch.float32) * torch.tensor(mass))
    above = [sum(d for d, k in zip(counts, kept) if k and d > c) / 4096 for c in counts]
    return [k and a < target for k, a in zip(kept, above)]


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.sampled_from([1, 6, 300]),
    top_k=st.sampled_from([1, 2, 5, 40, 0]),
    top_p=st.sampled_from([0.05, 0.5, 0.9, 0.999, 1.0]),
    most=st.sampled_from([1, 3, 60]),
    seed=st.integers(0, 2**31),
)
def test_the_accelerators_top_k_top_p_keeps_every_token_tied_at_a_cut(
    vocab, top_k, top_p, most, seed
):
    """Without a sort (`keyed_race.nucleus_floors`): on probabilities with many ties
    (multiples of 1/4096, so every sum is exact), exactly the tokens of the tie-aware
    definition, computed by brute force."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, most + 1, (3, vocab), generator=gen)
    counts[:, 0] += 1  # every row has mass
    k = top_k if 0 < top_k <= vocab else vocab
    got = top_k_top_p_unsorted(
        counts.float() / 4096, torch.full((3,), k), torch.full((3,), top_p), k * (k < vocab)
    )
    for row, kept in zip(counts.tolist(), got):
        want = _reference_kept_with_ties(row, k, top_p)
        assert (kept > 0).tolist() == [w and c > 0 for w, c in zip(want, row)]


def test_the_accelerators_top_p_cuts_at_exactly_top_p_and_keeps_ties():
    """More likely tokens holding exactly top_p of the mass cut a token; a token tied with
    a kept one is kept (the sorted filter keeps one of 0.25 and 0.25 at top_p 0.75)."""
    probs = torch.tensor([[0.5, 0.25, 0.25, 0.0]] * 2)
    kept = top_k_top_p_unsorted(probs, torch.tensor([4, 4]), torch.tensor([0.5, 0.75]), 0)
    assert (kept > 0).tolist() == [[True, False, False, False], [True, True, True, False]]


@pytest.mark.parametrize("full", [False, True])
def test_the_sorted_top_p_cuts_at_exactly_top_p(full):
    """Exact binary fractions: the kept tokens are the fewest most likely whose mass
    reaches top_p, as transformers' TopPLogitsWarper keeps them ([0.5] at 0.5)."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 2)
    kept = top_k_top_p(probs, torch.tensor([4, 4]), torch.tensor([0.5, 0.75]), full=full)
    assert (kept > 0).tolist() == [[True, False, False, False], [True, True, False, False]]


def test_top_p_cuts_a_token_one_ulp_below_a_kept_one():
    """[p, p less one ulp]: the first alone holds top_p 0.4 of the mass, so the second is
    cut by both filters, however close the two are (the unsorted filter's floor is the
    float just below the last kept probability)."""
    p = torch.tensor(0.5)
    probs = torch.stack([p, torch.nextafter(p, torch.tensor(0.0)), torch.tensor(0.0)])[None]
    k, top_p = torch.tensor([3]), torch.tensor([0.4])
    assert (top_k_top_p(probs, k, top_p, full=True) > 0).tolist() == [[True, False, False]]
    assert (top_k_top_p_unsorted(probs, k, top_p, 0) > 0).tolist() == [[True, False, False]]


def _unseeded_rows(settings: list[dict]) -> list[SampleRow]:
    """One `SampleRow` per settings dict (temperature 1 unless set), nothing else to it."""
    return [
        SampleRow(
            i, SamplingParams(**{"temperature": 1.0, **kw}), torch.Generator(), 0, None, [], None
        )
        for i, kw in enumerate(settings)
    ]


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(monkeypatch, accelerator):
    """top_p 1e-46 is valid (> 0) but 0 in float32: both ways keep the first token, as a
    top_p just above 0 would (not no token at all, nor every token)."""
    from lmprog_runtime import sampling

    monkeypatch.setattr(sampling, "on_accelerator", lambda device: accelerator)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    rows = _unseeded_rows([{"top_p": p} for p in (1e-46, 1e-3, 1.0)])
    kept = sampling._filtered_probs(logits, rows) > 0
    for i in (0, 1):
        assert kept[i].nonzero().flatten().tolist() == [int(logits[i].argmax())]
    assert bool(kept[2].all())


@pytest.mark.parametrize("accelerator", [False, True])
def test_a_top_k_beyond_the_vocabulary_cuts_nothing(monkeypatch, accelerator):
    """top_k has no upper bound: 2^70 (with top-p 0.9) keeps what top-p 0.9 alone keeps,
    beside a row with a small top_k."""
    from lmprog_runtime import sampling

    monkeypatch.setattr(sampling, "on_accelerator", lambda device: accelerator)
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(2)).repeat(3, 1)
    settings = [{"top_k": 2**70, "top_p": 0.9}, {"top_p": 0.9}, {"top_k": 5}]
    kept = sampling._filtered_probs(logits, _unseeded_rows(settings)) > 0
    assert torch.equal(kept[0], kept[1]) and 1 < int(kept[0].sum()) < 40
    assert sorted(kept[2].nonzero().flatten().tolist()) == sorted(
        logits[2].topk(5).indices.tolist()
    )


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 0.9), (40, 0.5), (5, 1.0), (400, 0.999)])
def test_the_accelerators_top_k_top_p_keeps_what_a_full_sort_keeps(seed, top_k, top_p):
    """Where no probabilities tie, the same tokens (and values) as the sorted filter."""
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(3000, generator=gen) for _ in range(4)])
    probs = torch.softmax(ranks / 3000 * 8, dim=-1)  # logits 0.0027 apart
    assert all(len(set(row.tolist())) == 3000 for row in probs)
    k = torch.full((4,), top_k or 3000)
    p = torch.full((4,), top_p)
    got = top_k_top_p_unsorted(probs, k, p, top_k)
    assert torch.equal(got, _reference_top_k_top_p(probs, k, p))


def test_a_row_that_cannot_be_drawn_fails_alone():
    """`sample_each`: a row without finite mass draws -1 (nothing read back: the caller
    fails its request); every other row draws what it draws alone, and its generator
    ends where that solo draw leaves it."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits[2] = float("nan")
    params = SamplingParams(temperature=0.8, top_p=0.9)

    def rows() -> list[SampleRow]:
        return [
            SampleRow(i, params, torch.Generator().manual_seed(7 + i), 0, None, [], None)
            for i in range(4)
        ]

    batch, solo = rows(), rows()
    token_ids, errors = sample_each(logits, batch)
    assert not errors and int(token_ids[2]) == -1  # the caller fails it, reading -1
    for i in (0, 1, 3):
        assert int(token_ids[i]) == int(sample_token_ids(logits[i : i + 1], [solo[i]])[0])
        assert torch.equal(batch[i].generator.get_state(), solo[i].generator.get_state())


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    vocab=st.sampled_from([1, 3, 64, 1000]),
    levels=st.integers(1, 4),
    special=st.sampled_from([None, float("nan"), float("-inf"), float("inf")]),
    seed=st.integers(0, 2**31),
)
def test_argmax_rows_is_argmax_ties_and_non_finite_values_included(
    rows, vocab, levels, special, seed
):
    """The greedy pick (`max`'s indices on a CPU) is torch's argmax: the first index among
    equal maxima (few distinct values: many ties), nan winning as in argmax."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, vocab), generator=gen).float()
    if special is not None:
        x.view(-1)[torch.randint(0, x.numel(), (3,), generator=gen)] = special
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_the_accelerator_path_reads_nothing_back():
    """On an accelerator a draw must not wait for the device (with overlap scheduling the
    next forward is queued behind it). The logits on the `meta` device stand for it: any
    value read back (`item`, `nonzero`, `bincount`, `tolist`) raises there, while every
    kind of row (greedy, temperature, top-k, top-p, min-p, penalties, banned tokens, a
    grammar mask) is drawn, and the penalties count its token."""
    vocab, counts = 300, PenaltyCounts()
    words = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)  # every token allowed
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.5, min_p=0.05),
        SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(temperature=1.2),
    ]
    rows = [
        SampleRow(i, p, torch.Generator().manual_seed(i), 17 + i,
                  PenaltyRow(counts, 2, [1, 2, 2]) if i == 4 else None,
                  [0] if i == 1 else [], words if i == 3 else None)
        for i, p in enumerate(params)
    ]  # fmt: skip
    logits = torch.empty(len(rows), vocab, device="meta")
    token_ids = sample_token_ids(logits, rows)
    assert token_ids.device.type == "meta" and token_ids.shape == (len(rows),)
    # The penalised row counted as it was, then its token counted (on the device).
    rows[4] = rows[4]._replace(penalty=PenaltyRow(counts, 2, None))
    token_ids, errors = sample_each(logits, rows)
    assert token_ids.shape == (len(rows),) and errors == {}


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.7]),
    top_k=st.sampled_from([-1, 1]),
    min_new=st.integers(0, 4),
    penalty=st.sampled_from([0.0, 0.5]),
    tokens=st.lists(st.integers(0, 40), max_size=8),
)
def test_a_requests_sample_row_is_taken_again_whenever_it_may_differ(
    temperature, top_k, min_new, penalty, tokens
):
    """`sample_rows` keeps a request's row once nothing in it can change (greedy, no
    penalties, no grammar, min_new_tokens reached); at every token, what it returns is what
    taking the row afresh gives."""
    from lmprog_runtime.request import Req
    from lmprog_runtime.sampling import sample_rows

    params = SamplingParams(
        temperature=temperature,
        top_k=top_k,
        min_new_tokens=min_new,
        frequency_penalty=penalty,
        stop_token_ids=[7],
        seed=3,
    )
    req = Req(0, [1, 2], params, tokenizer=None, eos_token_ids=frozenset({0}), context_len=99)
    counts = PenaltyCounts()
    for token in [*tokens, None]:
        (got,) = sample_rows([req], 50, counts)
        kept, req.plain_sample_row = req.plain_sample_row, None
        (fresh,) = sample_rows([req], 50, counts)
        req.plain_sample_row = kept
        assert got[:4] == fresh[:4] and sorted(got.banned) == sorted(fresh.banned)
        assert (got.penalty is None) == (fresh.penalty is None) and got.mask_words is None
        plain = params.is_greedy and not penalty and len(req.output_ids) >= min_new
        assert (req.plain_sample_row is not None) == plain
        if token is not None:
            req.output_ids.append(token)


@settings(max_examples=60, deadline=None)
@given(
    kinds=st.lists(
        st.sampled_from(["greedy", "top_k_1", "sampled", "penalty", "min_new"]), max_size=6
    ),
    seed=st.integers(0, 2**31),
)
def test_plain_rows_draw_what_the_general_path_draws(kinds, seed):
    """`sample_rows` marks its rows plain exactly when every row is greedy with no penalty,
    ban or mask; `sample_each` then takes their argmax, which is what drawing the same rows
    through the general path gives."""
    from lmprog_runtime.request import Req
    from lmprog_runtime.sampling import sample_rows

    settings_of = {
        "greedy": {"temperature": 0.0},
        "top_k_1": {"top_k": 1},
        "sampled": {"temperature": 0.8, "seed": 1},
        "penalty": {"temperature": 0.0, "frequency_penalty": 0.5},
        "min_new": {"temperature": 0.0, "min_new_tokens": 3},
    }
    reqs = [
        Req(
            i,
            [1, 2],
            SamplingParams(**settings_of[kind]),
            tokenizer=None,
            eos_token_ids=frozenset({0}),
            context_len=99,
        )
        for i, kind in enumerate(kinds)
    ]
    rows = sample_rows(reqs, 64, PenaltyCounts())
    expected = all(k in ("greedy", "top_k_1") for k in kinds)
    assert rows.plain == expected
    logits = torch.randn(len(reqs), 64, generator=torch.Generator().manual_seed(seed))
    if expected:
        fast, errors = sample_each(logits, rows)
        general, general_errors = sample_each(logits, list(rows))  # (not marked plain)
        assert fast.tolist() == general.tolist() == argmax_rows(logits).tolist()
        assert errors == general_errors == {}


class _CompleteMatcher:
    """A grammar's matcher whose match is complete and may go on with any token (the
    case where `end_outside_pattern` draws unmasked)."""

    def fill_mask_words(self, row: torch.Tensor) -> None:
        row.fill_(-1)  # every bit: every token allowed

    def is_complete(self) -> bool:
        return True

    def advance(self, token: int) -> None:
        pass


def test_a_constrained_requests_row_is_never_kept(monkeypatch):
    """A complete match draws unmasked, so its row reads plain; it is still taken afresh
    at every draw (its grammar decides the next mask), and a plain batch is drawn as its
    argmax without the per-row work."""
    from lmprog_runtime import sampling
    from lmprog_runtime.request import Req
    from lmprog_runtime.sampling import sample_rows

    params = SamplingParams(temperature=0.0, end_outside_pattern=True)
    matcher = _CompleteMatcher()
    req = Req(
        0,
        [1, 2],
        params,
        tokenizer=None,
        eos_token_ids=frozenset(),
        context_len=99,
        matcher=matcher,
        grammar=object(),
        grammar_eos=63,
    )
    plain_req = Req(1, [1, 2], params, tokenizer=None, eos_token_ids=frozenset(), context_len=99)
    for token in (5, 6, 7):
        rows = sample_rows([req, plain_req], 64, PenaltyCounts())
        assert rows.plain and rows[0].mask_words is None and req.end_words is not None
        assert req.plain_sample_row is None and plain_req.plain_sample_row is rows[1]
        req.output_ids.append(token)
        plain_req.output_ids.append(token)

    def per_row_work(*args):
        raise AssertionError("a plain batch went through the per-row work")

    monkeypatch.setattr(sampling, "_apply_penalties_and_masks", per_row_work)
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    tokens, errors = sample_each(logits, rows)
    assert tokens.tolist() == argmax_rows(logits).tolist() and errors == {}
