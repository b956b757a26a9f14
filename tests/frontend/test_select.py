"""`lp.select` on the tiny model against an independent transformers reference.

For a prompt P and a choice C the reference tokenizes P and P+C with the HF tokenizer, takes
k = the length of their common token prefix (clamped to [1, len(full) - 1]) and scores the
choice's tokens full[k:] with log_softmax(model(full).logits) at positions k-1 .. len-2; the
unconditional log-probs are SGLang's: those of the same tokens alone, the first counting
0. The three methods are re-implemented here from their definitions (SGLang's): mean
log-prob, greedy token-by-token comparison with shorter choices padded by their own mean,
and mean(cond - uncond). Cases include choices starting with a space, choices that are
prefixes of each other and prompts whose last token merges with the choice's first token.
"""

from __future__ import annotations

import pytest
import torch

import lmprog as lp

CASES = [
    ("Answer:", ["yes", "yes please", " no"]),
    ("Answer: ", ["yes", "yes please", "no"]),
    ("Score:", ["1", "10", "100"]),
    ("Score: ", ["1", "10", "100"]),  # the trailing space merges into " 1", " 10", " 100"
    ("Pick a colour:", [" red", " redder", "blue"]),
    ("The sky is", [" blue", " bl", "ue"]),
    ("The weather is n", ["ice", "asty", "ot"]),
    ("I want to go ho", ["me", "t", "rse"]),
    ("The cat sat on the m", ["at", "ouse", "ap"]),
    ("Number: 1", ["0", "00", "5"]),
    ("The count is 1", ["0", "00", " more"]),
    ("He said y", ["es", "ou", "eah"]),
    ("Is it true? ", ["Yes", "No", "Maybe"]),
    ("def add(a, b", ["):", "):\n", ", c):"]),
    ("x = 4", ["2", "0", " + 1"]),
    ("She is a teach", ["er", "ers", "ing"]),
    ("The capital of France is", [" Paris", " London", " Par"]),
    ("Hi", ["s", "gh", " there"]),
    ('{"name": "Alice", "age":', [" 31", " 3", ' "31"']),
    ("Dear customer, thank you for writing to us about your", [" parcel", " par", " order"]),
]
METHODS = [
    lp.token_length_normalized,
    lp.greedy_token_selection,
    lp.unconditional_likelihood_normalized,
]
TIE = 1e-4  # log-probs closer than this are mathematically equal (shared prefix tokens)


def _token_logprobs(model, ids: list[int], start: int) -> list[float]:
    """Log-probs of ids[start:] under the model given ids[:start]."""
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(start, len(ids))]


@pytest.fixture(scope="module")
def reference(hf_tiny):
    """(prompt, choice) -> (cond log-probs, uncond log-probs, k, len(prompt ids))."""
    model, tokenizer = hf_tiny
    out = {}
    for prompt, choices in CASES:
        p_ids = tokenizer(prompt).input_ids
        for choice in choices:
            full = tokenizer(prompt + choice).input_ids
            k = 0
            while k < min(len(p_ids), len(full)) and p_ids[k] == full[k]:
                k += 1
            k = max(1, min(k, len(full) - 1))
            cond = _token_logprobs(model, full, k)
            uncond = [0.0, *_token_logprobs(model, full[k:], 1)]
            assert len(cond) == len(uncond) == len(full) - k > 0
            out[prompt, choice] = (cond, uncond, k, len(p_ids))
    return out


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _reference_decision(method, cond: list[list[float]], uncond: list[list[float]]):
    """(index of the winner, scores) from the method's definition."""
    if method is lp.unconditional_likelihood_normalized:
        scores = [_mean([a - b for a, b in zip(c, u)]) for c, u in zip(cond, uncond)]
    else:
        scores = [_mean(c) for c in cond]
    if method is not lp.greedy_token_selection:
        return max(range(len(scores)), key=scores.__getitem__), scores
    width = max(len(c) for c in cond)
    padded = [c + [_mean(c)] * (width - len(c)) for c in cond]
    alive = list(range(len(cond)))
    for j in range(width):
        best = max(padded[i][j] for i in alive)
        alive = [i for i in alive if padded[i][j] >= best - TIE]
        if len(alive) == 1:
            break
    assert len(alive) == 1, f"greedy reference ends in a tie: {padded}"
    return alive[0], scores


@lp.function
def pick(s, prompt, choices, method):
    s += prompt + lp.select("x", choices=choices, choices_method=method)


def test_cases_cover_merges_spaces_and_prefix_choices(reference):
    assert len(CASES) == 20
    merged = [key for key, (_, _, k, n_prompt) in reference.items() if k < n_prompt]
    assert len(merged) >= 5, merged  # the choice's first token absorbs the prompt's last one
    assert any(c.startswith(" ") for _, cs in CASES for c in cs)
    assert any(a != b and b.startswith(a) for _, cs in CASES for a in cs for b in cs)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_select_matches_transformers(engine, reference, method):
    states = pick.run_batch(
        [{"prompt": p, "choices": cs, "method": method} for p, cs in CASES], backend=engine
    )
    decided_by_margin = 0
    for (prompt, choices), state in zip(CASES, states):
        assert state.error() is None, state.error()
        cond = [reference[prompt, c][0] for c in choices]
        uncond = [reference[prompt, c][1] for c in choices]
        want, ref_scores = _reference_decision(method, cond, uncond)
        meta = state.get_meta_info("x")
        where = f"{prompt!r} {choices} {method.name}: ref scores {ref_scores}, got {meta['scores']}"
        assert state["x"] == choices[want], where
        assert state.text() == prompt + choices[want]
        assert meta["method"] == method.name
        # The counts split the scored text's tokens where scoring began (a choice merged
        # with the prompt's last token counted that token twice).
        k = reference[prompt, choices[want]][2]
        assert (meta["prompt_tokens"], meta["completion_tokens"]) == (k, len(cond[want]))
        for got, ref in zip(meta["token_logprobs"], cond):
            assert got == pytest.approx(ref, abs=1e-4), where
        if method is not lp.greedy_token_selection:
            assert meta["scores"] == pytest.approx(ref_scores, abs=1e-4), where
            top, second = sorted(ref_scores, reverse=True)[:2]
            decided_by_margin += top - second > 1e-3
    if method is not lp.greedy_token_selection:
        assert decided_by_margin >= 15  # the decisions are not numerical coin flips


def test_select_meta_info_and_text(engine):
    @lp.function
    def prog(s):
        s += "Q: Is the sky blue?\nA:" + lp.select("ans", choices=[" yes", " no"])
        s += "\nColour:" + lp.gen("c", choices=[" red", " blue"])

    state = prog.run(backend=engine)
    meta = state.get_meta_info("ans")
    assert {"choice", "scores", "method"} <= set(meta)
    assert meta["choice"] == state["ans"] and state["ans"] in (" yes", " no")
    assert meta["method"] == "token_length_normalized" and len(meta["scores"]) == 2
    assert state.get_meta_info("c")["choice"] == state["c"]
    assert state.text() == "Q: Is the sky blue?\nA:" + state["ans"] + "\nColour:" + state["c"]
    # Each choice's scored tokens with their texts, as SGLang's select asks (they were None).
    for entries in meta["input_token_logprobs"]:
        assert entries and all(text == engine.decode([token]) for _, token, text in entries)
    # SGLang's normalized_prompt_logprobs: each choice's mean token logprob (the default
    # method's scores)
    means = [sum(lp for lp, *_ in e) / len(e) for e in meta["input_token_logprobs"]]
    assert meta["normalized_prompt_logprobs"] == pytest.approx(means)
    assert meta["scores"] == pytest.approx(means)


def test_greedy_selection_reads_float_noise_as_a_tie():
    """A shared first token scored in two requests differs by float noise only: the second
    token decides."""
    decision = lp.greedy_token_selection.decide([[-1.0, -3.0], [-1.0 - 1e-7, -0.5]])
    assert decision.index == 1


@pytest.mark.parametrize(
    "method", [lp.token_length_normalized, lp.unconditional_likelihood_normalized]
)
def test_an_exact_tie_goes_to_the_first_choice(method):
    """(as numpy's argmax, which SGLang's methods take)"""
    decision = method.decide([[-1.0], [-1.0], [-2.0]], [[0.0], [0.0], [0.0]])
    assert decision.index == 0


@pytest.mark.parametrize("choices", [[], None, ["a", "b", "a"], [" x", " x"]])
def test_select_rejects_empty_and_duplicate_choices(choices):
    with pytest.raises(ValueError):
        lp.select("x", choices=choices)
    if choices is not None:
        with pytest.raises(ValueError):
            lp.gen("x", choices=choices)
