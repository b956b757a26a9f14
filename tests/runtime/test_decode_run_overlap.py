"""Decode runs in the overlapped loop (`decode_steps` > 1 with overlap scheduling, as on
CUDA by default): a decode batch whose requests can all run ahead runs as decode runs,
any other batch (prompts, a grammar's) is overlapped, and the loop
goes from one to the other as requests come and go. The reference is the synchronous
engine with single steps: outputs, texts and finish reasons must be identical. Every test
ends with the engines clean (the autouse check in conftest).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import engine_leak
from helpers import PROMPTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from overlap_engines import (
    POOL,
    WORKERS,
    assert_each_draw_counts_its_tokens,
    assert_same_logprobs,
    assert_stream_aborts_match,
    count_launches_before_check,
    count_runs,
    count_runs_ahead,
    on_loop_thread,
    record_penalty_counts,
    result_key,
    slow_forward,
)

from lmprog_runtime import Engine
from lmprog_runtime.engine import RequestAborted
from lmprog_runtime.forward_batch import ForwardMode
from lmprog_runtime.forward_worker import ForwardWorker, InlineExecutor

STEPS = 4
REGEX = r"[a-z]{2,8}-[0-9]{2,4}( ok)?"
# A KV pool far smaller than the demand put on it, with short prefill chunks.
PRESSED = {"max_total_tokens": 160, "max_running_requests": 8, "chunked_prefill_size": 8}
# Kinds of requests, with `generate`'s return_logprob for each: a regex keeps a request's
# batch to single steps, the others run ahead.
KINDS = {
    "plain": ({}, False),
    "penalties": ({"frequency_penalty": 0.5, "presence_penalty": 0.3}, False),  # (counted
    # on the device past what the host holds)
    "logprobs": ({}, True),  # (runs ahead: gathered with each draw)
    "regex": ({"regex": REGEX, "ignore_eos": False}, False),
    "stops": ({"stop": ["e", "a"]}, False),  # (runs ahead: it may stop at any step)
    "min_new": ({"min_new_tokens": 6, "stop": ["e"], "ignore_eos": False}, False),  # (too)
}
RUN_AHEAD = ("plain", "penalties", "logprobs", "stops", "min_new")


@pytest.fixture(scope="module", params=list(WORKERS))
def engines(tiny_path, request):
    """(synchronous single steps, overlapped with runs of `STEPS`) on the tiny model; the
    overlapped engine's forward worker a thread or on the loop thread, its forward slow
    (so a thread's checks really run during the next forward), its runs launched ahead
    as on a GPU."""
    with (
        Engine(tiny_path, overlap_schedule=False, **POOL) as single,
        Engine(tiny_path, overlap_schedule=True, decode_steps=STEPS, **POOL) as both,
    ):
        if not WORKERS[request.param]:
            on_loop_thread(both)
        slow_forward(both)
        both._launches_ahead = True
        yield single, both


def like(engine: Engine, other: Engine) -> None:
    """`engine`'s forward worker runs its jobs as `other`'s does (on a thread of its own
    or on the loop thread; call it before `engine`'s first request)."""
    if isinstance(other._worker._executor, InlineExecutor):
        on_loop_thread(engine)


def record_turns(engine: Engine) -> list[str]:
    """A list of what `engine`'s loop does, in order: "run" for a decode run, "decode" for
    an overlapped decode step, "extend" for an overlapped prompt step."""
    turns: list[str] = []
    commit_runs, launch = engine._commit_runs, engine._launch

    def runs(run, start):
        if run is not None:
            turns.append("run")
        return commit_runs(run, start)

    def launched(batch):
        turns.append("decode" if batch.mode is ForwardMode.DECODE else "extend")
        return launch(batch)

    engine._commit_runs, engine._launch = runs, launched
    return turns


def stop_recording(engine: Engine) -> None:
    del engine._commit_runs, engine._launch


def test_an_abort_from_a_stream_ends_its_request_inside_a_run(engines):
    """Requests aborted from their streams' callbacks, inside runs and overlapped steps,
    get no chunk after their abort; the others produce what single steps produce."""
    single, both = engines
    params = [{"max_new_tokens": 30, "temperature": 0, "ignore_eos": True} for _ in range(6)]
    turns = record_turns(both)
    try:
        assert_stream_aborts_match(single, both, params, {1: 2, 3: 5, 4: 7})
    finally:
        stop_recording(both)
    assert "run" in turns


def test_runs_and_overlapped_steps_take_turns_and_match_single_steps(engines):
    """Requests that cannot run ahead keep their batches overlapped while they run; the
    others decode in runs before and after them, and after one submitted late; requests
    finish at every point (so some leave a batch held for a run while the step before is
    checked)."""
    single, both = engines
    base = {"temperature": 0, "ignore_eos": True}
    mix = [
        {**base, "max_new_tokens": 70},
        {"max_new_tokens": 45, "temperature": 0.8, "seed": 3, "ignore_eos": True},
        {**base, "max_new_tokens": 12, **KINDS["regex"][0]},
        {**base, "max_new_tokens": 9},
        {**base, "max_new_tokens": 32, **KINDS["regex"][0]},
        *({**base, "max_new_tokens": 30, "stop": [stop]} for stop in ("e", "a", "o", "i")),
        {"max_new_tokens": 23, "temperature": 0.9, "top_k": 5, "seed": 8},
        *({**base, "max_new_tokens": n} for n in (2, 5, 6, 7, 15)),
    ]
    logprobs = [False] * len(mix)
    logprobs[3] = True
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    late_params = {**base, "max_new_tokens": 10, **KINDS["regex"][0]}
    want = single.generate(prompts, mix, return_logprob=logprobs)
    late_want = single.generate(PROMPTS[6], late_params)
    late: list = []

    def on_chunk(i: int, chunk: dict) -> None:
        if i == 0 and chunk["meta_info"]["completion_tokens"] >= 40 and not late:
            late.extend(both.submit([PROMPTS[6]], [late_params]))

    turns = record_turns(both)
    early = count_launches_before_check(both)
    try:
        futures = both.submit(prompts, mix, return_logprob=logprobs, on_chunk=on_chunk)
        got = [f.result(timeout=120) for f in futures]
        late_got = late[0].result(timeout=120)
    finally:
        stop_recording(both)
        del both._launch_before_check
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    assert result_key(late_got) == result_key(late_want)
    for mine, theirs in zip(got, want):
        assert_same_logprobs(mine, theirs)
    # Overlapped decode steps, then runs; again after the late request, then runs.
    assert any(early)  # (runs launched before the check of the step before them)
    text = " ".join(turns)
    first_run = text.index("run")
    assert "decode" in text[:first_run]
    assert "run" in text[text.index("decode", text.index("extend", first_run)) :]


def test_penalties_in_runs_count_each_token_once(engines, monkeypatch):
    """Each draw of a run counts, for its penalties, exactly the tokens its request has by
    then: those the host holds, then, on the device, those since (the first step's input,
    in a run launched before the check a placeholder resolved there; the tokens of the
    run before, not yet committed, in a run launched ahead; the run's own). In order they
    are the first tokens of the request's output, and the token drawn is the next one.
    Outputs equal single steps'."""
    single, both = engines
    counted = record_penalty_counts(monkeypatch)
    mix = [
        {"max_new_tokens": 30 + 5 * i, "ignore_eos": True, "frequency_penalty": 0.6}
        | ({"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": i})
        | ({"presence_penalty": -0.5} if i == 2 else {})
        for i in range(4)
    ]
    prompts = PROMPTS[: len(mix)]
    early, ahead = count_launches_before_check(both), count_runs_ahead(both)
    try:
        got = both.generate(prompts, mix)
    finally:
        del both._launch_before_check, both._launch_run
    assert [result_key(o) for o in got] == [result_key(o) for o in single.generate(prompts, mix)]
    assert_each_draw_counts_its_tokens(
        counted, {o["meta_info"]["id"]: o["output_ids"] for o in got}
    )
    assert any(early) and ahead


@pytest.mark.parametrize("before_check", [True, False], ids=["launched", "held"])
def test_a_request_that_stops_at_the_check_before_a_run_leaves_it(engines, before_check):
    """A run is launched before the step before it is checked (as on a GPU), or held
    until then (as on a CPU); a request that the check stops (a stop string) leaves it,
    its pages freed, and the run goes on without it."""
    single, both = engines
    base = {"temperature": 0, "ignore_eos": True}
    stops = ("e", "a", "o", "i", "t", "n")
    mix = [{**base, "max_new_tokens": 30, "stop": [stop]} for stop in stops]
    mix.append({**base, "max_new_tokens": 40})
    prompts = PROMPTS[: len(mix)]
    want = single.generate(prompts, mix)
    run_held, run_batch, left = both._run_held, both._run_batch, []

    def held():
        left.append(("held", len(both._in_flight.left)))
        return run_held()

    def launched(batch, run=None, since=None):
        if run is not None:
            left.append(("launched", sum(req.done.is_set() for req in batch.reqs)))
        return run_batch(batch, run, since)

    both._run_held, both._run_batch = held, launched
    both._launches_ahead = before_check
    try:
        got = both.generate(prompts, mix)
    finally:
        del both._run_held, both._run_batch
        both._launches_ahead = True
    assert [result_key(o) for o in got] == [result_key(o) for o in want]
    way = "launched" if before_check else "held"
    assert any(n for kind, n in left if kind == way)


def test_a_fault_in_a_run_and_in_an_overlapped_step_fails_one_request_each(engines):
    """A request fails in an overlapped step (one with a regex), another in a run: each
    fails alone, the others come out as without them."""
    single, both = engines
    base = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    mix = [base, base, {**base, "max_new_tokens": 5, **KINDS["regex"][0]}, base]
    want = single.generate(PROMPTS[:4], mix)
    # Request 1 breaks in the first run that carries it (and stays broken: the run's first
    # step alone then finds it), request 2 in an overlapped step.
    fails_in_run = {tuple(both.encode(PROMPTS[1])): True, tuple(both.encode(PROMPTS[2])): False}
    in_run, failed = [False], []  # (where the hook failed a request: in a run or not)

    def hook(at: str, req) -> None:
        in_a_run = fails_in_run.get(tuple(req.input_ids))
        broken = in_a_run is in_run[0] or (in_a_run and True in failed)
        if at == "forward" and broken and len(req.output_ids) >= 2:
            failed.append(in_run[0])
            raise RuntimeError("injected")

    launch_run = both._launch_run

    def marked(*args, **kwargs):
        in_run[0] = True
        try:
            return launch_run(*args, **kwargs)
        finally:
            in_run[0] = False

    both.fault_hook, both._launch_run = hook, marked
    try:
        futures = both.submit(PROMPTS[:4], mix)
        got = [f.exception(timeout=60) or f.result() for f in futures]
    finally:
        both.fault_hook = None
        del both._launch_run
    assert all(isinstance(got[i], RuntimeError) for i in (1, 2))
    assert [result_key(got[i]) for i in (0, 3)] == [result_key(want[i]) for i in (0, 3)]
    assert set(failed) == {True, False}


def test_pool_pressure_retracts_and_the_outputs_match(tiny_path, engines):
    """A pool far smaller than the demand, requests that can and cannot run ahead: runs
    stop short, requests are retracted and resume exactly."""
    single, both = engines
    prompts = list(PROMPTS)
    mix = [{"max_new_tokens": 30 + i, "temperature": 0, "ignore_eos": True} for i in range(8)]
    mix[1] = {**mix[1], "max_new_tokens": 12, **KINDS["regex"][0]}
    mix[5] = {**mix[5], "max_new_tokens": 16, **KINDS["regex"][0]}
    config = {"overlap_schedule": True, "decode_steps": 8, **PRESSED}
    with Engine(tiny_path, **config) as engine:
        like(engine, both)
        engine._launches_ahead = True
        turns = record_turns(engine)
        got = engine.generate(prompts, mix)
        stats = engine.stats()
    assert stats["retracted_requests"] > 0 and "run" in turns and "decode" in turns
    assert [result_key(o) for o in got] == [result_key(o) for o in single.generate(prompts, mix)]


@settings(max_examples=16, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 40),  # max_new_tokens
            st.sampled_from([None, 0, 11]),  # greedy or a seed
            st.sampled_from(["plain", "plain", *KINDS]),
            st.sampled_from([None, None, 1, 6]),  # aborted after this many chunks
        ),
        min_size=2,
        max_size=8,
    ),
    st.booleans(),  # a pressed pool
    st.sampled_from([1, 4]),  # page size
    st.booleans(),  # runs launched ahead (as off a CPU) or not
)
def test_random_mixes_match_single_steps(tiny_path, engines, plan, pressed, page, ahead):
    """Random mixes of requests that can and cannot run ahead (these shorter, so that the
    loop goes from overlapped steps to runs), aborted from their streams,
    in the engines' pool or one far smaller than the demand (retractions and evictions),
    on pages of 1 or 4 slots: a request not aborted produces exactly what single steps
    produce."""
    single, both = engines
    prompts = [PROMPTS[p] for p, *_ in plan]
    mix = [
        {
            "max_new_tokens": n if kind in RUN_AHEAD else min(n, 10),
            "temperature": 0 if seed is None else 0.9,
            "seed": seed,
            "ignore_eos": True,
            **KINDS[kind][0],
        }
        for _, n, seed, kind, _ in plan
    ]
    for params in mix:
        if "min_new_tokens" in params:
            params["min_new_tokens"] = min(params["min_new_tokens"], params["max_new_tokens"])
    logprobs = [KINDS[kind][1] for _, _, _, kind, _ in plan]
    pool = PRESSED if pressed else POOL
    config = {"overlap_schedule": True, "decode_steps": STEPS, "page_size": page, **pool}
    with Engine(tiny_path, **config) as engine:
        like(engine, both)
        engine._launches_ahead = ahead

        def on_chunk(i: int, chunk: dict) -> None:
            if chunk["meta_info"]["completion_tokens"] == plan[i][4]:
                engine.abort(chunk["meta_info"]["id"])

        futures = engine.submit(prompts, mix, return_logprob=logprobs, on_chunk=on_chunk)
        results = [f.exception(timeout=120) or f.result() for f in futures]
        assert engine_leak(engine) is None
    want = single.generate(prompts, mix, return_logprob=logprobs)
    for (*_, abort_after), params, got, out in zip(plan, mix, results, want):
        if isinstance(got, RequestAborted):
            assert abort_after is not None and abort_after < params["max_new_tokens"]
        else:
            assert result_key(got) == result_key(out)
            assert_same_logprobs(got, out)


def test_runs_without_overlap_are_untouched(tiny_path):
    """On a CPU, decode_steps alone leaves the loop synchronous: the runs take it."""
    with Engine(tiny_path, decode_steps=STEPS, max_total_tokens=1024) as engine:
        assert engine._worker is None
        taken = count_runs(engine)
        engine.generate(PROMPTS[:2], [{"max_new_tokens": 12, "temperature": 0}] * 2)
    assert taken


def test_a_run_starts_only_after_the_worker_hands_over(engines):
    """Each run that takes over from the overlapped loop is launched (before the check of
    the step before it) or run (held until then) only after the worker's hand-over (on
    CUDA: the loop's stream waits for the worker's)."""
    _, both = engines
    events: list[str] = []
    hand_over, launch, run_batch = (
        both._worker.hand_over,
        both._launch_before_check,
        both._run_batch,
    )

    def handing_over():
        events.append("hand_over")
        return hand_over()

    def launching(batch, steps):
        events.append("launch")
        return launch(batch, steps)

    def running(batch, run=None, since=None):
        events.append("run")
        return run_batch(batch, run, since)

    both._worker.hand_over, both._launch_before_check = handing_over, launching
    both._run_batch = running
    try:
        both.generate(PROMPTS[:3], [{"max_new_tokens": 20, "temperature": 0}] * 3)
    finally:
        del both._worker.hand_over, both._launch_before_check, both._run_batch
    assert "launch" in events and "run" in events
    handed = False
    for before, event in zip(["start", *events], events):
        if event == "launch":
            assert before == "hand_over"
        elif event == "run":
            assert handed
        handed = event == "hand_over" or (handed and event == "launch")


def test_a_failure_preparing_a_run_before_the_check_holds_the_batch(engines):
    """Allocating a run's steps raises before the check: the batch is held and runs after
    it; nothing fails, nothing leaks (the autouse check)."""
    single, both = engines
    mix = [{"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}] * 3
    want = single.generate(PROMPTS[:3], mix)
    extend, calls = both.scheduler.extend_decode_run, []

    def failing_once(batch, steps, needs):
        calls.append(steps)
        if len(calls) == 1:
            raise RuntimeError("injected before the check")
        return extend(batch, steps, needs)

    both.scheduler.extend_decode_run = failing_once
    try:
        got = both.generate(PROMPTS[:3], mix)
    finally:
        del both.scheduler.extend_decode_run
    assert len(calls) > 1
    assert [result_key(o) for o in got] == [result_key(o) for o in want]


def test_a_runs_launch_counts_in_the_steps_seconds(engines):
    """With a deadline in the batch each run waits for the commit of the one before (none
    is launched ahead of it), so it is launched in an iteration that checks nothing: the
    seconds of its launch still count as its step's."""
    _, both = engines
    prepare_run, launches = both.runner.prepare_run, []

    def slow_prepare_run(batch, ahead):
        launches.append(len(ahead))
        time.sleep(0.02)
        return prepare_run(batch, ahead)

    both.runner.prepare_run = slow_prepare_run
    both.reset_stats()
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "timeout_s": 120}
    try:
        both.generate(PROMPTS[:2], [params] * 2)
    finally:
        del both.runner.prepare_run
    stats = both.stats()
    assert len(launches) >= 3 and stats["decode_runs"] == len(launches)
    assert stats["step_seconds"] >= 0.02 * len(launches)


def test_hand_over_waits_for_the_worker_threads_jobs():
    """A decode run takes over from the overlapped loop only once the worker's thread has
    run all it was given (the run then uses the model on the loop thread)."""
    done = threading.Event()

    def slow_run(fb):
        time.sleep(0.2)
        done.set()
        return torch.zeros(1)

    runner = SimpleNamespace(device=torch.device("cpu"), run=slow_run)
    worker = ForwardWorker(runner, threaded=True)
    try:
        worker.launch(SimpleNamespace())
        worker.hand_over()
        assert done.is_set()
    finally:
        worker.close()
