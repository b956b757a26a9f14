"""Three admission rules, each seen in what the scheduler admits (`scheduler_sim.Sim`):

- `dfs-weight` takes first the requests under the cached node that most waiting requests
  share (`fcfs` and `lpm` take them by arrival where their matches are equally long);
- a request sharing a whole block (`SHARED_PREFIX_BLOCK` tokens) of not-yet-cached prompt
  with one admitted this step waits a step, then reuses it from the cache;
- admission sets aside room for the output each request has still to draw (the share
  `new_token_ratio` expects), for those running and the one coming in alike."""

from __future__ import annotations

import pytest
from scheduler_sim import Sim

from lmprog_runtime.schedule_policy import SHARED_PREFIX_BLOCK

P, Q = list(range(1, 41)), list(range(100, 140))


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_dfs_weight_takes_the_heavier_subtree_first(policy):
    """One request under the cached prefix P, then three under Q: one admitted at a time,
    `dfs-weight` takes two of Q's first (Q's subtree weighs 3, then 2, against P's 1)."""
    sim = Sim(policy, max_running=1, pool=1024)
    for key in (P, Q):
        sim.tree.insert(key, sim.allocator.alloc(len(key)))
    (under_p,) = sim.submit([P + [500, 501]], 2)
    under_q = [sim.submit([Q + [600 + i, 700 + i]], 2)[0] for i in range(3)]
    for _ in range(100):
        sim.step()
    q_rids = {req.rid for req in under_q}
    assert sorted(sim.admitted) == sorted([under_p.rid, *q_rids])
    if policy == "dfs-weight":
        assert set(sim.admitted[:2]) <= q_rids
    else:
        assert sim.admitted[0] == under_p.rid
    sim.tree.flush()
    assert sim.is_clean()


@pytest.mark.parametrize("extra", [0, 1])
def test_a_request_sharing_a_whole_uncached_block_waits_a_step(extra):
    """(`extra`: one token short of a block, it goes in at once and computes it all)"""
    sim = Sim("fcfs", max_running=4, pool=1024)
    block = list(range(1, SHARED_PREFIX_BLOCK + 1 - extra))
    first, second = sim.submit([block + [900, 901]], 2)[0], sim.submit([block + [902, 903]], 2)[0]
    sim.step()
    assert sim.admitted == ([first.rid] if not extra else [first.rid, second.rid])
    for _ in range(20):
        sim.step()
    assert sim.computed[second.rid] == (2 if not extra else len(block) + 2)
    sim.tree.flush()
    assert sim.is_clean()


def test_a_new_request_waits_while_the_running_ones_output_would_not_fit():
    """A pool of 300: A (10 + 200 new) runs, 0.7 of its output set aside; B (10 + 250 new)
    would need 10 + 0.7 x 250 more, which is not there: it waits until A is done."""
    sim = Sim("fcfs", max_running=4, pool=300)
    (a,) = sim.submit([list(range(1, 11))], 200)
    sim.step()
    (b,) = sim.submit([list(range(50, 60))], 250)
    for _ in range(5):
        sim.step()
    assert sim.admitted == [a.rid]
    for _ in range(500):
        sim.step()
    assert sim.admitted == [a.rid, b.rid] and sim.is_clean()


def test_a_retracted_request_sets_aside_only_the_output_it_has_left():
    """A (10 + 100 new) is retracted with 80 tokens drawn, next to B (10 + 150 new): A
    sets aside its 20 tokens to go (at the ratio 1.0 a retraction sets) and goes in
    again at once; set aside for all 100, it waited for B to end."""
    sim = Sim("fcfs", max_running=4, pool=300)
    (a,) = sim.submit([list(range(1, 11))], 100)
    (b,) = sim.submit([list(range(50, 60))], 150)
    while len(a.output_ids) < 80:
        sim.step()
    sim.sched.retract(a)
    sim.step()
    assert a in sim.sched.running and len(b.output_ids) < 150
    for _ in range(500):
        sim.step()
    assert len(a.output_ids) == 100 and len(b.output_ids) == 150
    assert sim.retracted == {a.rid: 1} and sim.is_clean()
