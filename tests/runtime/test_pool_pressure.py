"""A KV pool too small for the requests at once: requests wait, or are retracted and
claim their K/V back later, and finish with the tokens a roomy engine gives, in each loop
(synchronous, overlapped, decode runs). The autouse check in conftest finds the engine
clean after each test."""

from __future__ import annotations

import random

import pytest

from lmprog_runtime import Engine

LOOPS = {"sync": {}, "overlap": {"overlap_schedule": True}, "runs": {"decode_steps": 4}}
SHARED = random.Random(0).sample(range(5, 900), 16)  # (a prefix two requests share)
FORCED = "[0-9]{11}the quick brown fox jumps over the lazy dog[0-9]{40}"


def _outputs(engine: Engine, first: list, then: tuple) -> list[dict | BaseException]:
    """`first` submitted together; `then` (ids, params) submitted from the first one's
    first chunk, once its prompt is in the cache. Each result, or its error."""
    later: list = []

    def on_chunk(i: int, chunk: dict) -> None:
        if i == 0 and not later:
            later.extend(engine.submit(input_ids=[then[0]], sampling_params=then[1]))

    ids, params = zip(*first)
    futures = engine.submit(input_ids=list(ids), sampling_params=list(params), on_chunk=on_chunk)
    outs = [f.exception(timeout=120) or f.result() for f in futures]
    return outs + [later[0].exception(timeout=120) or later[0].result()]


@pytest.mark.parametrize("loop", list(LOOPS))
@pytest.mark.parametrize("policy", ["lpm", "dfs-weight", "fcfs"])
def test_a_request_waiting_after_a_jump_forward_gives_its_kv_back_when_short(
    tiny_path, loop, policy
):
    """B jumps forward over a pattern's forced text and waits to extend it, still holding
    its K/V. C, sharing A's cached prefix, comes first in the queue's order and does not
    fit; admission stops there and never reached B. A, decoding alone, ran the pool dry:
    "KV pool exhausted by a single request", three times, and every request failed. Now B
    gives its K/V back (to the cache), and all three finish as in a roomy engine."""
    greedy = {"temperature": 0, "ignore_eos": True}
    first = [
        (SHARED + [11, 12, 13, 14], {**greedy, "max_new_tokens": 86}),
        ([21, 22, 23, 24, 25, 26], {"max_new_tokens": 30, "temperature": 0, "regex": FORCED}),
    ]
    then = (SHARED + [31, 32, 33, 34], {**greedy, "max_new_tokens": 86})
    with Engine(tiny_path, max_total_tokens=4096) as roomy:
        expected = _outputs(roomy, first, then)
    with Engine(tiny_path, max_total_tokens=112, schedule_policy=policy, **LOOPS[loop]) as e:
        e.grammar("regex", FORCED)  # (compiled before: B jumps at its first step)
        outs = _outputs(e, first, then)
        assert e.stats()["jump_forward_tokens"] > 0
    for out, want in zip(outs, expected):
        assert not isinstance(out, BaseException), out
        assert out["output_ids"] == want["output_ids"]


@pytest.mark.parametrize("loop", list(LOOPS))
def test_a_retracted_request_claiming_its_own_kv_back_counts_none_as_cached(tiny_path, loop):
    """Retracted, a request's K/V go to the cache, and its admission claims them back:
    they counted as prompt tokens served from the cache (more than its prompt held), and
    the engine's count passed every prompt token submitted."""
    rng = random.Random(3)
    prompts = [[rng.randint(5, 900) for _ in range(rng.randint(6, 10))] for _ in range(8)]
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, max_total_tokens=4096) as roomy:
        expected = roomy.generate(input_ids=prompts, sampling_params=params)
    config = {"max_total_tokens": 64, "schedule_conservativeness": 0.0, **LOOPS[loop]}
    with Engine(tiny_path, **config) as e:
        outs = e.generate(input_ids=prompts, sampling_params=params)
        stats = e.stats()
    assert stats["retracted_requests"] > 0
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in expected]
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0] * len(prompts)
    assert stats["cached_tokens"] == 0
