"""No waiting request is passed without bound by later ones, under any policy: a steady
stream of requests that share a cached prefix went in ahead of a prompt sharing none
(`lpm` sorted it last at every step), and lone requests took every freed row ahead of a
fork's group that needed several at once (under `fcfs` too). Once `MAX_OVERTAKES` later
requests have gone in past a waiting request, it goes first and admission stops at it.

And a prompt prefilled in chunks goes in only when its whole remaining prompt fits the
pool: with room for its first chunk only, it went in, filled the pool and was retracted,
its chunks computed again.

The scheduler runs here on its own (`scheduler_sim.Sim`)."""

from __future__ import annotations

import random

import pytest
from scheduler_sim import Sim

from lmprog_runtime.request import Req
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.schedule_policy import MAX_OVERTAKES, first_in_line

POLICIES = ["fcfs", "lpm", "dfs-weight"]
SHARED = list(range(1, 61))  # the stream's common prefix (cached after its first request)


def _stream(
    sim: Sim,
    rng: random.Random,
    steps: int,
    waiting: int,
    watch: list[Req],
    longest: int = 9,
    own: int = 4,
    jump_every: int = 0,
) -> None:
    """`steps` steps of a steady load: the queue kept at `waiting` requests that share the
    cached prefix (then `own` tokens of their own, up to `longest` new tokens), until every
    watched request went in (or the steps ran out); every `jump_every` steps a running
    request jumps forward."""
    for step in range(steps):
        while len(sim.sched.waiting) < waiting:
            ids = SHARED + [rng.randrange(100, 2000) for _ in range(own)]
            sim.submit([ids], rng.randint(2, longest))
        if jump_every and step % jump_every == 0:
            _jump_forward_one(sim)
        sim.step()
        if all(r.rid in sim.admitted for r in watch):
            return


def _jump_forward_one(sim: Sim) -> None:
    """A running request's output grows by a forced token (no K/V yet): it goes back to
    the front of the queue to extend it, as jump-forward puts it."""
    for req in sim.sched.running:
        if len(req.output_ids) < req.max_new_tokens - 1:
            req.output_ids.append(9)
            sim.sched.jump_forward(req)
            return


def _drain(sim: Sim) -> None:
    for _ in range(10_000):
        if not sim.sched.has_work:
            break
        sim.step()
    assert sim.is_clean()


def _warm(policy: str, max_running: int = 4, pool: int = 2048, chunk: int = 0):
    sim, rng = Sim(policy, max_running, pool, chunk), random.Random(0)
    _stream(sim, rng, 30, waiting=8, watch=[])
    return sim, rng


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("jump_every", [0, 4])
def test_a_prompt_sharing_no_cached_prefix_goes_in(policy, jump_every):
    """(`jump_every`: requests that jump forward go in front of it for a step, now and
    then; counted for the queue's head only, its count started over each time, and it
    waited out 12,000 later requests)"""
    sim, rng = _warm(policy)
    lone = sim.submit([[rng.randrange(100, 2000) for _ in range(30)]], 4)
    _stream(sim, rng, 4000, waiting=8, watch=lone, jump_every=jump_every)
    assert lone[0].rid in sim.admitted
    assert sim.passed_by(lone) <= MAX_OVERTAKES + 4  # (plus what one step admits)
    if policy != "fcfs":  # (sorted last, it goes in first only once 32 went past it: each
        # request jumped forward, admitted again, counted once more, it went after 5)
        assert sim.passed_by(lone) >= MAX_OVERTAKES
    _drain(sim)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_group_needing_several_rows_goes_in(policy):
    """(the stream's requests of many lengths: ending apart, each frees one row at a time)"""
    sim, rng = _warm(policy, max_running=8)
    group = sim.submit([SHARED + [3000 + i] for i in range(6)], 12)
    _stream(sim, rng, 3000, waiting=8, watch=group, longest=60)
    assert all(r.rid in sim.admitted for r in group)
    assert sim.passed_by(group) <= MAX_OVERTAKES + 8
    _drain(sim)


@pytest.mark.parametrize("policy", POLICIES)
def test_a_long_prompt_in_chunks_goes_in_when_all_of_it_fits(policy):
    """A 600-token prompt (chunks of 64) in a 1,024-slot pool among requests that keep it
    over half full: it waits for room for all of it, then goes in once and is never
    retracted (with room for one chunk only, it went in at once and was retracted as the
    pool filled, its chunks computed again)."""
    sim, rng = _warm(policy, max_running=8, pool=1024, chunk=64)
    long = sim.submit([[rng.randrange(100, 2000) for _ in range(600)]], 8)
    _stream(sim, rng, 4000, waiting=12, watch=long, longest=40, own=60)
    assert long[0].rid in sim.admitted
    _drain(sim)
    assert sim.retracted.get(long[0].rid, 0) == 0
    assert sim.computed[long[0].rid] == 600  # (its prompt's K/V, computed once)


def _waiting(overtaken: list[int]) -> list[Req]:
    """Requests in arrival order, each passed by `overtaken[i]` later ones."""
    reqs = []
    for rid, count in enumerate(overtaken):
        params = SamplingParams(max_new_tokens=4)
        req = Req(rid, [rid + 1], params, tokenizer=None, eos_token_ids=frozenset(), context_len=64)
        req.overtaken = count
        reqs.append(req)
    return reqs


def test_the_first_in_line_is_the_oldest_starved_request_whatever_the_queue_order():
    older, newer, fresh = _waiting([MAX_OVERTAKES + 5, MAX_OVERTAKES + 5, 0])
    assert first_in_line([newer, fresh, older]) is older
    assert first_in_line([fresh, newer]) is newer


def test_a_request_is_first_in_line_once_exactly_max_overtakes_passed_it():
    (req,) = _waiting([MAX_OVERTAKES - 1])
    assert first_in_line([req]) is None
    req.overtaken = MAX_OVERTAKES
    assert first_in_line([req]) is req
