"""The radix prefix cache on the real engine: reuse, page sizes, memory pressure, chunked
prefill, request groups, and the reference documents' eviction and scheduling examples.

Greedy outputs are checked against transformers' own `generate(do_sample=False)` of the same
checkpoint: with the cache cold, warm, one prompt at a time or off, and under a pool so small
that the engine evicts and retracts, with page sizes 1, 4 and 16 on every attention backend
(`make test` runs a subset of that matrix, `pytest -m slow` the rest)."""

from __future__ import annotations

import json
import shutil
import threading

import pytest
import torch
from helpers import hf_greedy_ids

from lmprog_runtime import Engine

SYSTEM = list(range(100, 100 + 96))  # a shared "system prompt" of 96 token ids
MAX_NEW_TOKENS = 12


def _ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 2000, (n,), generator=gen).tolist()


def _workload() -> list[list[int]]:
    """Prompts with nested shared prefixes: a system prompt, two tasks, distinct questions."""
    tasks = [_ids(1, 40), _ids(2, 23)]
    return [SYSTEM + tasks[i % 2] + _ids(10 + i, 5 + 3 * i) for i in range(12)]


def _greedy(engine: Engine, prompts, max_new_tokens=MAX_NEW_TOKENS, ignore_eos=False):
    # EOS is not ignored by default: transformers' generate stops at it too.
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]


def _hf_generate(hf_tiny, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate`, one prompt at a time (no padding involved)."""
    outs = hf_greedy_ids(hf_tiny[0], prompts, max_new_tokens)
    # A reference cut short by EOS would make the workload (and its pressure) lighter.
    assert all(len(o) == max_new_tokens for o in outs)
    return outs


@pytest.fixture(scope="module")
def reference(hf_tiny):
    return _hf_generate(hf_tiny, _workload(), MAX_NEW_TOKENS)


def _clean(engine: Engine) -> None:
    state = engine.memory_state()
    assert state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
    assert state["kv_slots_locked"] == 0 and state["req_slots_free"] == state["req_slots_total"]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_greedy_is_identical_with_the_cache_cold_and_warm(tiny_path, reference, page_size):
    with Engine(tiny_path, page_size=page_size, max_total_tokens=8192) as engine:
        cold = _greedy(engine, _workload())
        cold_cached = engine.stats()["cached_tokens"]
        engine.reset_stats()
        warm = _greedy(engine, _workload())
        warm_stats = engine.stats()
        # One after another, each prompt finds its predecessors' prefixes.
        engine.flush_cache()
        one_by_one = [_greedy(engine, [p])[0] for p in _workload()]
        _clean(engine)
    assert cold == reference and warm == reference and one_by_one == reference
    assert cold_cached > 0
    total_prompt = sum(len(p) for p in _workload())
    # Warm: every prompt is cached up to its last (partial) page.
    assert warm_stats["prefill_tokens"] <= len(_workload()) * page_size
    assert warm_stats["cached_tokens"] >= total_prompt - len(_workload()) * page_size


@pytest.mark.parametrize("conservativeness", [1.0, 0.0])
def test_a_pool_a_tenth_of_the_workload_evicts_and_retracts(tiny_path, reference, conservativeness):
    prompts = _workload()
    needed = sum(len(p) + 12 for p in prompts)
    with Engine(
        tiny_path,
        max_total_tokens=needed // 10,
        schedule_conservativeness=conservativeness,
    ) as engine:
        outs = _greedy(engine, prompts)
        stats = engine.stats()
        _clean(engine)
    assert outs == reference
    assert stats["evicted_tokens"] > 0
    if conservativeness == 0.0:
        assert stats["retracted_requests"] > 0


def _pressure_workload() -> list[list[int]]:
    """Six prompts under a 24-token system prompt and two task prefixes: the nested sharing
    of `_workload` at a size Triton can afford under the interpreter."""
    system = _ids(3, 24)
    tasks = [_ids(1, 10), _ids(2, 6)]
    return [system + tasks[i % 2] + _ids(10 + i, 3 + 2 * i) for i in range(6)]


PRESSURE_NEW_TOKENS = 6
# `make test` runs every page size on the default (native) backend and one page size on each
# of the others; `pytest -m slow` runs the rest of the matrix.
FAST_PRESSURE_CASES = {("native", 1), ("native", 4), ("native", 16), ("torch", 4), ("triton", 16)}
PRESSURE_CASES = [
    pytest.param(
        backend,
        page_size,
        marks=() if (backend, page_size) in FAST_PRESSURE_CASES else pytest.mark.slow,
    )
    for backend in ("native", "torch", "triton")
    for page_size in (1, 4, 16)
]


@pytest.fixture(scope="module")
def pressure_reference(hf_tiny):
    return _hf_generate(hf_tiny, _pressure_workload(), PRESSURE_NEW_TOKENS)


@pytest.mark.parametrize(("backend", "page_size"), PRESSURE_CASES)
def test_greedy_under_pressure_matches_transformers(
    tiny_path, pressure_reference, backend, page_size
):
    """A pool a fifth of the workload (or one request plus a page, whichever is larger), with
    nothing reserved for future output: the engine evicts cached prefixes and retracts running
    requests, and every greedy output still equals transformers' `generate`."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts = _pressure_workload()
    needs = [len(p) + PRESSURE_NEW_TOKENS for p in prompts]
    pages_for_largest = -(-max(needs) // page_size) + 1
    pool = max(sum(needs) // 5, pages_for_largest * page_size)
    with Engine(
        tiny_path,
        attention_backend=backend,
        page_size=page_size,
        max_total_tokens=pool,
        schedule_conservativeness=0.0,
    ) as engine:
        assert engine.runner.attention_backend == backend
        outs = _greedy(engine, prompts, PRESSURE_NEW_TOKENS)
        stats = engine.stats()
        _clean(engine)
    assert outs == pressure_reference
    assert stats["evicted_tokens"] > 0 and stats["retracted_requests"] > 0


@pytest.mark.parametrize("together", [True, False])
def test_sixteen_requests_share_a_512_token_prefix_computed_once(engine, together):
    prefix = _ids(7, 512)
    suffixes = [_ids(100 + i, 8 + i) for i in range(16)]
    prompts = [prefix + s for s in suffixes]
    assert engine.flush_cache()
    engine.reset_stats()
    params = {"max_new_tokens": 2, "temperature": 0}
    if together:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    else:
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    stats = engine.stats()
    assert stats["prefill_tokens"] <= 512 + sum(len(s) for s in suffixes)
    assert stats["cached_tokens"] >= 15 * 512
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) >= 15 * 512


@pytest.fixture(scope="module")
def long_context_tiny(tiny_path, tmp_path_factory):
    """The tiny checkpoint with a 4096-token context (same weights; RoPE has no table)."""
    path = tmp_path_factory.mktemp("tiny4k")
    shutil.copytree(tiny_path, path, dirs_exist_ok=True)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    ("locked", "expected_evicted", "forwards"),
    [(["C"], 900, 1), (["A", "C"], 600, 1), (["A", "B", "C"], None, 2)],
)
def test_eviction_walkthrough_of_the_reference(
    long_context_tiny, locked, expected_evicted, forwards
):
    """Capacity 4,000 tokens; shared node S of 2,000 with branches A (900), B (600), C (400)
    used in that order; the running requests lock their branches; D = S + 500 new tokens."""
    s_ids = _ids(20, 2000)
    branch = {"A": _ids(21, 900), "B": _ids(22, 600), "C": _ids(23, 400)}
    d_ids = s_ids + _ids(24, 500)
    prefill_only = {"max_new_tokens": 0}
    with Engine(long_context_tiny, max_total_tokens=4000, chunked_prefill_size=0) as engine:
        for name in "ABC":
            engine.generate(input_ids=s_ids + branch[name], sampling_params=prefill_only)
        assert engine.memory_state()["kv_slots_cached"] == 3900
        engine.reset_stats()
        # The requests of `locked` are running when D arrives (same admission step); each
        # continues its branch by one new token, so its whole branch is matched and locked.
        prompts = [s_ids + branch[name] + [77] for name in locked] + [d_ids]
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 1, "temperature": 0})
        stats = engine.stats()
        assert stats["forward_passes"] == forwards
        if expected_evicted is not None:
            assert stats["evicted_tokens"] == expected_evicted  # the LRU unlocked leaf, whole
        else:
            # Everything was locked: D waited for A, B and C to finish, then evicted.
            assert stats["evicted_tokens"] >= 400
        # S always survives: it is shared, and never an unlocked leaf.
        out = engine.generate(input_ids=s_ids + _ids(25, 10), sampling_params=prefill_only)
        assert out["meta_info"]["cached_tokens"] >= 2000
        _clean(engine)


@pytest.mark.parametrize(("policy", "expected"), [("fcfs", 126), ("lpm", 46), ("dfs-weight", 46)])
def test_cache_aware_scheduling_practice(tiny_path, policy, expected):
    """Two agents X, Y, three requests each (own 20-token prompt + 1 token), interleaved,
    with a cache that holds one request at a time: longest-prefix-first reuses."""
    x, y = _ids(30, 20), _ids(31, 20)
    prompts = [x + [5], y + [6], x + [7], y + [8], x + [9], y + [11]]
    with Engine(tiny_path, max_total_tokens=30, schedule_policy=policy) as engine:
        engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0})
        assert engine.stats()["prefill_tokens"] == expected
        _clean(engine)


@pytest.mark.parametrize("mixed", [True, False])
def test_chunked_prefill_interleaves_with_decode(tiny_path, mixed):
    long_prompt = _ids(40, 600)
    with Engine(
        tiny_path,
        chunked_prefill_size=64,
        max_total_tokens=4096,
        disable_mixed_batches=not mixed,
    ) as engine:
        reference = _greedy(engine, [long_prompt], 5, ignore_eos=True)
        engine.flush_cache()
        trace: list[tuple[str, list[int]]] = []
        forward = engine.runner.forward

        def traced(batch):
            trace.append((batch.mode.name, [r.rid for r in batch.reqs]))
            return forward(batch)

        engine.runner.forward = traced
        results = {}
        runner = threading.Thread(
            target=lambda: results.setdefault(
                "short", _greedy(engine, [_ids(41, 10)], 150, ignore_eos=True)
            )
        )
        runner.start()
        while not any(mode == "DECODE" for mode, _ in trace):
            pass
        results["long"] = _greedy(engine, [long_prompt], 5, ignore_eos=True)
        runner.join()
        _clean(engine)
    assert results["long"] == reference
    long_rid = max(rid for _, rids in trace for rid in rids)
    chunks = [i for i, (mode, rids) in enumerate(trace) if mode == "EXTEND" and long_rid in rids]
    assert len(chunks) == -(-600 // 64)
    short_rid = min(rid for _, rids in trace for rid in rids)
    if mixed:  # the running request decodes in the same forward as each chunk
        assert all(short_rid in trace[i][1] for i in chunks)
    else:  # decode steps alternate with the chunks
        decodes_between = [
            i
            for i, (mode, _) in enumerate(trace)
            if mode == "DECODE" and chunks[0] < i < chunks[-1]
        ]
        assert len(decodes_between) >= len(chunks) - 1


def test_request_group_computes_its_prefix_once_and_decodes_together(engine):
    prefix = _ids(50, 300)
    prompts = [prefix + _ids(51 + i, 6) for i in range(4)]
    assert engine.flush_cache()
    engine.reset_stats()
    trace = []
    forward = engine.runner.forward
    engine.runner.forward = lambda b: (trace.append((b.mode.name, len(b.reqs))), forward(b))[1]
    try:
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0}, group=True
        )
    finally:
        del engine.runner.forward
    stats = engine.stats()
    assert stats["prefill_tokens"] <= 300 + 4 * 6
    assert all(o["meta_info"]["cached_tokens"] >= 300 for o in outs)
    decode_sizes = [n for mode, n in trace if mode == "DECODE"]
    assert decode_sizes and all(n == 4 for n in decode_sizes)


def test_flush_cache_and_disabled_cache(tiny_path, reference):
    with Engine(tiny_path, max_total_tokens=2048) as engine:
        _greedy(engine, _workload()[:3])
        assert engine.memory_state()["kv_slots_cached"] > 0
        assert engine.flush_cache() is True
        state = engine.memory_state()
        assert state["kv_slots_cached"] == 0 and state["kv_slots_free"] == state["kv_slots_total"]
    with Engine(tiny_path, max_total_tokens=2048, disable_radix_cache=True) as engine:
        assert _greedy(engine, _workload()[:3] * 2) == reference[:3] * 2
        assert engine.stats()["cached_tokens"] == 0
        assert engine.memory_state()["kv_slots_free"] == engine.memory_state()["kv_slots_total"]


@pytest.mark.parametrize(
    "limits",
    [{"max_running_requests": 4}, {"max_prefill_tokens": 64}, {"max_total_tokens": 160}],
)
def test_a_group_larger_than_the_engine_limits_runs_in_parts(tiny_path, limits):
    prefix = _ids(60, 24)
    prompts = [prefix + _ids(61 + i, 6) for i in range(10)]
    config = {"max_total_tokens": 4096, **limits}
    params = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, **config) as engine:
        grouped = engine.generate(input_ids=prompts, sampling_params=params, group=True)
        alone = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
        _clean(engine)
    assert [o["output_ids"] for o in grouped] == [o["output_ids"] for o in alone]


def test_a_group_that_fits_the_pool_one_member_at_a_time_runs_in_parts(tiny_path):
    """Four branches of one prompt, each alone within the pool (53 + 200 of 300 slots) and
    no two together: the group goes in parts, and a member left waiting must not take the
    admitted members' claims back with its own (they once lost their rows, and the pool
    its slots)."""
    prompts = [_ids(70, 53)] * 4
    params = {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, max_total_tokens=300, max_running_requests=4) as engine:
        grouped = engine.generate(input_ids=prompts, sampling_params=params, group=True)
        _clean(engine)
        alone = engine.generate(input_ids=prompts[0], sampling_params=params)
        _clean(engine)
    assert [o["output_ids"] for o in grouped] == [alone["output_ids"]] * 4


def test_a_blocked_group_is_tried_once_a_step(tiny_path):
    """130 prompts over a shared prefix in a 300-slot pool: while the group waited, each of
    its members claimed and gave back the rows of all the others, every step (1.8 million
    row claims, 12.6 s against 0.6 s ungrouped). Now a step claims each row once at most."""
    prefix = _ids(80, 60)
    prompts = [prefix + _ids(81 + i, 1 + i % 30) for i in range(130)]
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    outputs, claims, steps = {}, {}, {}
    for group in (False, True):
        with Engine(tiny_path, max_total_tokens=300) as engine:
            table = engine.runner.req_to_token
            alloc, count = table.alloc, [0]

            def counted(alloc=alloc, count=count):
                count[0] += 1
                return alloc()

            table.alloc = counted
            outs = engine.generate(input_ids=prompts, sampling_params=params, group=group)
            outputs[group], claims[group] = [o["output_ids"] for o in outs], count[0]
            steps[group] = engine.stats()["forward_passes"]
            _clean(engine)
    assert outputs[True] == outputs[False]
    assert claims[True] <= (len(prompts) + 1) * steps[True], (claims, steps)


def test_a_request_needing_the_whole_pool_is_not_overtaken(tiny_path):
    """A 540-token prompt in a 600-slot pool fits only once the running requests finish:
    later short requests were admitted past it as room freed, so under a steady load it
    waited for the whole queue (90 s and 12,000 requests in a probe). It stops admission,
    as in SGLang, and finishes before the requests that came after it."""
    short = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, max_total_tokens=600, schedule_policy="fcfs") as engine:
        finished: list[str] = []
        futures = engine.submit(
            input_ids=[_ids(90 + i, 50) for i in range(16)], sampling_params=short
        )
        (long,) = engine.submit(
            input_ids=[_ids(200, 540)], sampling_params={**short, "max_new_tokens": 20}
        )
        long.add_done_callback(lambda _: finished.append("long"))
        later = engine.submit(
            input_ids=[_ids(300 + i, 50) for i in range(40)], sampling_params=short
        )
        for future in later:
            future.add_done_callback(lambda _: finished.append("later"))
        for future in [*futures, long, *later]:
            future.result(timeout=120)
        _clean(engine)
    assert finished.index("long") < 5, finished
