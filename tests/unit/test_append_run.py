"""`Req.append_run`: a decode run's tokens appended at once, up to the one that finishes
the request, against appending and checking them one at a time (`Req.append_token`)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams

TOKENS = st.integers(0, 9)


def make_req(params: dict, eos: frozenset[int], held: list[int]) -> Req:
    req = Req(
        0, [1, 2, 3], SamplingParams(**params), tokenizer=None, eos_token_ids=eos, context_len=10**6
    )
    req.output_ids = list(held)
    return req


# What ends a request checked by its last token alone: EOS, stop tokens, ignore_eos,
# min_new_tokens and max_new_tokens (hypothesis strategies, by argument).
ENDINGS = {
    "eos": st.frozensets(TOKENS, max_size=2),
    "stops": st.lists(TOKENS, max_size=2),
    "ignore_eos": st.booleans(),
    "min_new": st.integers(0, 8),
    "max_new": st.integers(1, 12),
}


def ending_params(stops: list[int], ignore_eos: bool, min_new: int, max_new: int) -> dict:
    return {
        "max_new_tokens": max_new,
        "min_new_tokens": min(min_new, max_new),
        "stop_token_ids": stops,
        "ignore_eos": ignore_eos,
    }


@settings(max_examples=300, deadline=None)
@given(
    **ENDINGS,
    held=st.lists(TOKENS, max_size=6),
    run=st.lists(TOKENS, min_size=1, max_size=8),
)
def test_a_run_appends_and_finishes_as_its_tokens_one_by_one(
    eos, stops, ignore_eos, min_new, max_new, held, run
):
    """Tokens from EOS, stop tokens or neither; min_new_tokens before or inside the run;
    max_new_tokens inside it or past it. The output and finish reason equal the one-by-one
    reference's, which stops at the first token that finishes the request."""
    max_new = max(max_new, len(held) + 1)  # (a request in a run has a token left)
    params = ending_params(stops, ignore_eos, min_new, max_new)
    want = make_req(params, eos, held)
    for token in run:
        want.append_token(token)
        if want.finished_reason is not None:
            break
    got = make_req(params, eos, held)
    assert got.checks_last_token_alone
    took = got.append_run(run)
    got.check_last_token()
    assert took == len(got.output_ids) - len(held)
    assert got.output_ids == want.output_ids
    assert got.finished_reason == want.finished_reason


def test_stop_strings_and_grammars_are_checked_token_by_token():
    assert not make_req({"stop": ["ab"]}, frozenset(), []).checks_last_token_alone
    assert not make_req({"stop_regex": ["a+"]}, frozenset(), []).checks_last_token_alone
    grammar = make_req({}, frozenset(), [])
    grammar.matcher = object()
    assert not grammar.checks_last_token_alone


@settings(max_examples=300, deadline=None)
@given(**ENDINGS, held=st.lists(TOKENS, min_size=1, max_size=12))
def test_continues_plainly_is_a_check_that_finds_nothing(
    eos, stops, ignore_eos, min_new, max_new, held
):
    """`continues_plainly` (the loop's shortcut) is true exactly when `check_last_token`
    would leave the request going on, for requests checked by their last token alone."""
    req = make_req(ending_params(stops, ignore_eos, min_new, max_new), eos, held)
    plainly = req.continues_plainly()
    req.check_last_token()
    assert plainly == (req.finished_reason is None)


def test_what_a_check_does_besides_finishing_is_never_skipped():
    """Stop strings, grammars, jump-forward and streams need the full check every token."""
    going_on = {"max_new_tokens": 9}
    assert make_req(going_on, frozenset(), [4]).continues_plainly()
    assert not make_req({**going_on, "stop": ["ab"]}, frozenset(), [4]).continues_plainly()
    for name in ("matcher", "char_fsm", "stream_queue", "on_chunk"):
        req = make_req(going_on, frozenset(), [4])
        setattr(req, name, object())
        assert not req.continues_plainly(), name
