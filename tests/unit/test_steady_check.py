"""`SteadyCheck`: a decode batch checked as a whole while it stays the same, against
checking each request's new token (`Req.check_last_token`, on copies)."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.steady_check import SteadyCheck

TOKENS = st.integers(0, 9)
REQUEST = st.fixed_dictionaries(
    {
        "eos": st.frozensets(TOKENS, max_size=2),
        "stops": st.lists(TOKENS, max_size=2),
        "ignore_eos": st.booleans(),
        "min_new": st.integers(0, 10),
        "max_new": st.integers(2, 14),
        "held": st.integers(1, 3),
    }
)


def make_req(spec: dict) -> Req:
    params = SamplingParams(
        max_new_tokens=spec["max_new"],
        min_new_tokens=min(spec["min_new"], spec["max_new"]),
        stop_token_ids=spec["stops"],
        ignore_eos=spec["ignore_eos"],
    )
    req = Req(0, [1, 2], params, tokenizer=None, eos_token_ids=spec["eos"], context_len=10**6)
    req.output_ids = [20] * min(spec["held"], spec["max_new"] - 1)  # (none may end)
    return req


def finishes_any(reqs: list[Req]) -> bool:
    """The reference: whether checking each request's last token finishes one."""
    for req in reqs:
        probe = copy.copy(req)
        probe.check_last_token()
        if probe.finished_reason is not None:
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(REQUEST, min_size=1, max_size=5), data=st.data())
def test_a_steady_batch_settles_only_while_none_finishes(specs, data):
    """Step after step each request gets one token (often one that may end some request).
    The batch never settles at a step where checking each request would finish one; it
    settles at each step where none finishes and no new token is any request's EOS or
    stop token."""
    reqs = [make_req(spec) for spec in specs]
    steady = SteadyCheck(reqs)
    ends = frozenset().union(*(req.eos_token_ids | req.stop_token_ids for req in reqs))
    settled = 0
    for _ in range(16):
        for req in reqs:
            req.output_ids.append(data.draw(TOKENS))
        finishes = finishes_any(reqs)
        settles = steady.settles(list(reqs))
        assert not (settles and finishes)
        if not finishes and ends.isdisjoint(req.output_ids[-1] for req in reqs):
            assert settles
        if not settles:
            break
        settled += 1
    assert steady.num_checks == settled


def test_settles_only_for_the_same_requests_one_token_longer_each():
    """A different list (another order, one left out), or a request two tokens longer: no
    settling, though no request's check would finish it."""
    spec = {
        "eos": frozenset({2}),
        "stops": [],
        "ignore_eos": False,
        "min_new": 0,
        "max_new": 50,
        "held": 1,
    }
    reqs = [make_req(spec) for _ in range(3)]
    steady = SteadyCheck(reqs)
    for req in reqs:
        req.output_ids.append(7)
    assert not steady.settles(reqs[::-1])
    assert not steady.settles(reqs[:2])
    assert steady.settles(reqs)
    for req in reqs:
        req.output_ids.append(7)
    reqs[0].output_ids.append(7)
    assert not steady.settles(reqs)


def test_tokens_that_end_requests_settle_while_min_new_tokens_is_unreached():
    """EOS drawn by every request while each is under its min_new_tokens: nothing may end
    it, so the batch settles; at min_new_tokens the same token ends them, and it does not."""
    spec = {"eos": frozenset({2}), "stops": [], "ignore_eos": False, "min_new": 4, "max_new": 50}
    reqs = [make_req({**spec, "held": 1}) for _ in range(3)]  # (1 token each)
    steady = SteadyCheck(reqs)
    for _ in range(2):  # tokens 2 and 3: under min_new_tokens
        for req in reqs:
            req.output_ids.append(2)
        assert not finishes_any(reqs)
        assert steady.settles(reqs)
    for req in reqs:
        req.output_ids.append(2)  # token 4: min_new_tokens reached
    assert finishes_any(reqs)
    assert not steady.settles(reqs)
