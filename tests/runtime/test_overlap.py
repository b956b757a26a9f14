"""Overlap scheduling (issue 18): the loop checks step N's tokens while step N+1's forward
runs, with results token-identical to the synchronous loop.

Both engines get a fake slow forward (a sleep before the real one: a device still busy),
so in the overlapped engine the checks of one step really run during the next forward. The
reference is the same engine built with `overlap_schedule=False`. Every test ends with the
engines clean (the autouse check in conftest): a request that finishes while a forward that
carries it runs gives that forward's slots back at once.
"""

from __future__ import annotations

import gc
import json
import re
import threading
import time
import weakref

import jsonschema
import pytest
from conftest import engine_leak
from helpers import PROMPTS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmprog_runtime import Engine
from lmprog_runtime.config import RuntimeConfig
from lmprog_runtime.engine import RequestAborted

SLOW_FORWARD_S = 0.003
POOL = {"max_total_tokens": 4096, "max_running_requests": 16}
SCHEMA = {
    "type": "object",
    "properties": {
        "customer_name": {"type": "string", "maxLength": 6},
        "is_priority": {"type": "boolean"},
    },
    "required": ["customer_name", "is_priority"],
}


def _slow_forward(engine: Engine) -> None:
    run = engine.runner.run

    def slow_run(fb):
        time.sleep(SLOW_FORWARD_S)  # the device is still busy (not a synchronisation)
        return run(fb)

    engine.runner.run = slow_run


@pytest.fixture(scope="module")
def engines(tiny_path):
    """(synchronous, overlapped) engines on the tiny model, both with a slow forward."""
    with (
        Engine(tiny_path, overlap_schedule=False, **POOL) as sync,
        Engine(tiny_path, overlap_schedule=True, **POOL) as overlapped,
    ):
        assert sync._worker is None and overlapped._worker is not None
        _slow_forward(sync)
        _slow_forward(overlapped)
        yield sync, overlapped


@pytest.fixture(scope="module", params=[1, 4], ids=["page1", "page4"])
def pressed(tiny_path, request):
    """An overlapped engine whose KV pool is far smaller than the demand put on it, with
    short prefill chunks, on pages of 1 and 4 slots."""
    with Engine(
        tiny_path,
        max_total_tokens=160,
        max_running_requests=8,
        chunked_prefill_size=8,
        page_size=request.param,
        overlap_schedule=True,
    ) as engine:
        yield engine


def _key(out: dict) -> tuple:
    meta = out["meta_info"]
    return out["output_ids"], out["text"], meta["finish_reason"], meta["completion_tokens"]


def _stop_inside(engine: Engine, prompt: str, params: dict) -> str:
    """A stop string the unstopped output contains past its start (so it stops mid-run)."""
    text = engine.generate(prompt, params)["text"]
    assert len(text) > 8
    return text[len(text) // 2 : len(text) // 2 + 2]


def test_overlap_schedule_is_validated_and_on_for_cuda_only():
    assert not RuntimeConfig().is_overlapped
    assert RuntimeConfig(device="cuda").is_overlapped
    assert RuntimeConfig(device="cuda:1").is_overlapped
    assert RuntimeConfig(overlap_schedule=True).is_overlapped
    assert not RuntimeConfig(device="cuda", overlap_schedule=False).is_overlapped
    for bad in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match="overlap_schedule"):
            RuntimeConfig(overlap_schedule=bad)


def test_outputs_are_token_identical_to_the_synchronous_loop(engines):
    """Requests finishing at different steps (lengths, EOS, stop strings and regexes, a
    prefill-only one), greedy and seeded, with penalties, min_new_tokens and logprobs, all
    in one batch."""
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    mix = [
        {"max_new_tokens": 1, "temperature": 0},
        {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        {"max_new_tokens": 0},
        {"max_new_tokens": 17, "temperature": 0.8, "seed": 7},
        {**unstopped, "stop": [_stop_inside(sync, PROMPTS[4], unstopped)]},
        {**unstopped, "stop_regex": [re.escape(_stop_inside(sync, PROMPTS[5], unstopped))]},
        {"max_new_tokens": 30, "temperature": 1.0, "top_p": 0.9, "seed": 3},
        {"max_new_tokens": 20, "temperature": 0, "frequency_penalty": 0.5, "min_new_tokens": 9},
        {"max_new_tokens": 9, "temperature": 0.7, "seed": 1, "presence_penalty": 0.3},
        {"max_new_tokens": 40, "temperature": 0},
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(mix))]
    kwargs = {"return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0}
    want = sync.generate(prompts, mix, **kwargs)
    got = overlapped.generate(prompts, mix, **kwargs)
    assert [_key(o) for o in got] == [_key(o) for o in want]
    assert {o["meta_info"]["finish_reason"]["type"] for o in want} == {"length", "stop"}
    for g, w in zip(got, want):
        for name in ("input_token_logprobs", "output_token_logprobs"):
            assert [t for _, t in g["meta_info"][name]] == [t for _, t in w["meta_info"][name]]
            lps = [lp for lp, _ in g["meta_info"][name]]
            assert lps == pytest.approx([lp for lp, _ in w["meta_info"][name]], abs=1e-5)


def test_a_caller_wakes_to_free_slots_and_the_synchronous_counters(engines):
    """When `generate` returns, the slots of the forward launched for the requests that had
    just finished are already free, and the counters equal the synchronous loop's (the
    dropped tokens of that forward are not counted)."""
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [{**unstopped, "max_new_tokens": n} for n in (1, 4, 9, 13)]
    mix.append({**unstopped, "stop": [_stop_inside(sync, PROMPTS[4], unstopped)]})
    outs, stats = [], []
    for engine in (sync, overlapped):
        assert engine.flush_cache()
        engine.reset_stats()
        outs.append([_key(o) for o in engine.generate(PROMPTS[:5], mix)])
        state, counters = engine.memory_state(), engine.stats()  # no waiting: at once
        assert state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
        assert state["kv_slots_locked"] == 0 and state["num_running"] == 0
        assert state["req_slots_free"] == state["req_slots_total"]
        stats.append({k: v for k, v in counters.items() if not k.endswith("_seconds")})
    assert outs[1] == outs[0]
    assert stats[1] == stats[0]
    assert stats[0]["finished_requests"] == len(mix)


def test_streamed_chunks_are_identical_in_order_and_content(engines):
    sync, overlapped = engines
    unstopped = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    mix = [
        {**unstopped, "stop": [_stop_inside(sync, PROMPTS[2], unstopped)]},
        {"max_new_tokens": 12, "temperature": 0.9, "seed": 5},
        {**unstopped, "max_new_tokens": 3},
        unstopped,
    ]
    prompts = [PROMPTS[2], PROMPTS[3], PROMPTS[6], PROMPTS[7]]

    def chunks(engine: Engine) -> tuple[list, list]:
        seen: list[list] = [[] for _ in mix]

        def on_chunk(i: int, chunk: dict) -> None:
            meta = {k: v for k, v in chunk["meta_info"].items() if k != "id"}
            seen[i].append((chunk["text"], chunk["output_ids"], meta))

        assert engine.flush_cache()

        futures = engine.submit(prompts, mix, on_chunk=on_chunk)
        outs = [f.result(timeout=60) for f in futures]
        single = [
            (c["text"], c["output_ids"]) for c in engine.generate(PROMPTS[1], mix[1], stream=True)
        ]
        return seen + [single], outs

    want_chunks, want = chunks(sync)
    got_chunks, got = chunks(overlapped)
    assert got_chunks == want_chunks
    assert [_key(o) for o in got] == [_key(o) for o in want]
    for seen, out in zip(got_chunks, got):
        assert "".join(text for text, _, _ in seen) == out["text"]


def test_constrained_outputs_match_and_are_identical(engines):
    """A JSON schema (jump-forward on) and a regex with logprobs (jump-forward off): the
    grammar mask of each step follows the token the previous step's check accepted."""
    sync, overlapped = engines
    regex = r"[a-z]{2,6}-[0-9]{2,4}( ok)?"
    mix = [
        {"max_new_tokens": 80, "temperature": 0, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 80, "temperature": 0.9, "seed": 2, "json_schema": json.dumps(SCHEMA)},
        {"max_new_tokens": 16, "temperature": 0.8, "seed": 4, "regex": regex},
        {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    ]
    prompts = ["Extract: Alice ordered", "Extract: Bob", "Code:", PROMPTS[4]]
    sync.reset_stats()
    overlapped.reset_stats()
    want = sync.generate(prompts, mix, return_logprob=[False, False, True, False])
    got = overlapped.generate(prompts, mix, return_logprob=[False, False, True, False])
    assert [_key(o) for o in got] == [_key(o) for o in want]
    for out in got[:2]:
        jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert re.fullmatch(regex, got[2]["text"])
    jumped = sync.stats()["jump_forward_tokens"]
    assert jumped > 0 and overlapped.stats()["jump_forward_tokens"] == jumped


def test_prefix_cache_hits_are_identical(engines):
    """A prompt, the same prompt continued by its output, and a fork of two branches."""
    sync, overlapped = engines
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}

    def run(engine: Engine) -> list[tuple]:
        assert engine.flush_cache()
        first = engine.generate(PROMPTS[7], params)
        again = engine.generate(PROMPTS[7] + first["text"] + " and", params)
        branches = engine.generate([PROMPTS[6] + " x", PROMPTS[6] + " y"], params, group=True)
        outs = [first, again, *branches]
        return [(*_key(o), o["meta_info"]["cached_tokens"]) for o in outs]

    want, got = run(sync), run(overlapped)
    assert got == want
    assert all(cached > 0 for *_, cached in want[1:])


def test_aborts_mid_run_end_their_request_and_spare_the_others(engines):
    """Each request to abort is aborted from its own stream after a few chunks."""
    sync, overlapped = engines
    params = [
        {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "seed": i} for i in range(6)
    ]
    aborted_after = {1: 1, 3: 4, 4: 7}

    def run(engine: Engine) -> tuple[list, list]:
        counts = [0] * len(params)

        def on_chunk(i: int, chunk: dict) -> None:
            counts[i] += 1
            if counts[i] == aborted_after.get(i):
                engine.abort(chunk["meta_info"]["id"])

        futures = engine.submit(PROMPTS[:6], params, on_chunk=on_chunk)
        return [f.exception(timeout=60) or f.result() for f in futures], counts

    want, _ = run(sync)
    got, counts = run(overlapped)
    for i, (g, w) in enumerate(zip(got, want)):
        if i in aborted_after:
            assert isinstance(g, RequestAborted) and isinstance(w, RequestAborted)
            assert counts[i] == aborted_after[i]  # no chunk after the abort was seen
        else:
            assert _key(g) == _key(w)


def _fail_when(engine: Engine, point: str, prompt: str, num_output_ids: int):
    ids = engine.encode(prompt)

    def hook(at: str, req) -> None:
        if at == point and req.input_ids == ids and len(req.output_ids) == num_output_ids:
            raise RuntimeError(f"injected at {point}")

    return hook


@pytest.mark.parametrize(
    ("point", "num_output_ids"), [("forward", 0), ("forward", 3), ("sample", 2)]
)
def test_a_fault_fails_its_request_and_the_others_are_identical(engines, point, num_output_ids):
    """The culprit fails in its prefill or mid-decode, among requests decoding beside it."""
    sync, overlapped = engines
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = sync.generate(PROMPTS, params)
    overlapped.fault_hook = _fail_when(overlapped, point, PROMPTS[2], num_output_ids)
    try:
        futures = overlapped.submit(PROMPTS, params)
        results = [f.exception(timeout=60) or f.result() for f in futures]
    finally:
        overlapped.fault_hook = None
    for i, (got, out) in enumerate(zip(results, want)):
        if i == 2:
            assert f"injected at {point}" in str(got)
        else:
            assert _key(got) == _key(out)
    assert overlapped.generate(PROMPTS[2], params)["output_ids"] == want[2]["output_ids"]


def test_checks_run_while_the_next_forward_runs(tiny_path, engines):
    """Structural proof of overlap: the checks of step N and the forward of step N+1 meet
    at a barrier, which needs both to be in progress at once (the synchronous loop runs
    them one after the other: the barrier would time out there)."""
    sync, _ = engines
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_path, overlap_schedule=True, **POOL) as engine:
        barrier = threading.Barrier(2, timeout=30)
        met = []
        run, check = engine.runner.run, engine._check
        num_forwards = [0]

        def meeting_run(fb):
            num_forwards[0] += 1
            if 2 <= num_forwards[0] <= 4:  # forwards 2-4 run during the checks of steps 1-3
                met.append(("forward", threading.current_thread().name, barrier.wait()))
            return run(fb)

        num_checks = [0]

        def meeting_check(reqs):
            num_checks[0] += 1
            if num_checks[0] <= 3:  # the checks of steps 1-3
                met.append(("check", threading.current_thread().name, barrier.wait()))
            return check(reqs)

        engine.runner.run = meeting_run
        engine._check = meeting_check
        out = engine.generate(PROMPTS[3], params)
    assert out["output_ids"] == sync.generate(PROMPTS[3], params)["output_ids"]
    assert sorted(kind for kind, _, _ in met) == ["check"] * 3 + ["forward"] * 3
    forward_threads = {name for kind, name, _ in met if kind == "forward"}
    check_threads = {name for kind, name, _ in met if kind == "check"}
    assert forward_threads.isdisjoint(check_threads)


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(
            st.integers(0, len(PROMPTS) - 1),
            st.integers(1, 40),  # max_new_tokens
            st.sampled_from([None, 0, 11]),  # greedy or a seed
            st.sampled_from([None, 1, 5]),  # aborted after this many chunks
        ),
        min_size=1,
        max_size=10,
    )
)
def test_random_mixes_under_pool_pressure_match_the_synchronous_loop(engines, pressed, plan):
    """Retractions and evictions (a 160-token pool) while steps overlap; a request not
    aborted produces exactly what the synchronous loop produces."""
    sync, _ = engines

    def params(max_new: int, seed: int | None) -> dict:
        temperature = 0 if seed is None else 0.9
        return {"max_new_tokens": max_new, "temperature": temperature, "seed": seed}

    prompts = [PROMPTS[p] for p, _, _, _ in plan]
    mix = [{**params(max_new, seed), "ignore_eos": True} for _, max_new, seed, _ in plan]

    def on_chunk(i: int, chunk: dict) -> None:
        if chunk["meta_info"]["completion_tokens"] == plan[i][3]:
            pressed.abort(chunk["meta_info"]["id"])

    futures = pressed.submit(prompts, mix, on_chunk=on_chunk)
    results = [f.exception(timeout=120) or f.result() for f in futures]
    want = sync.generate(prompts, mix)
    for (_, max_new, _, abort_after), got, out in zip(plan, results, want):
        if isinstance(got, RequestAborted):
            assert abort_after is not None and abort_after < max_new
        else:
            assert _key(got) == _key(out)
    assert engine_leak(pressed) is None


def test_pool_pressure_retracts_and_the_outputs_match_the_synchronous_loop(engines, pressed):
    """Retracted requests resume exactly; a constrained request jumps forward meanwhile."""
    sync, _ = engines
    prompts = [*PROMPTS, "Extract: Alice ordered"]
    mix = [{"max_new_tokens": 30 + i, "temperature": 0, "ignore_eos": True} for i in range(8)]
    mix.append({"max_new_tokens": 60, "temperature": 0, "json_schema": json.dumps(SCHEMA)})
    assert pressed.flush_cache()
    pressed.reset_stats()
    got = pressed.generate(prompts, mix)
    stats = pressed.stats()
    assert stats["retracted_requests"] > 0 and stats["jump_forward_tokens"] > 0
    assert [_key(o) for o in got] == [_key(o) for o in sync.generate(prompts, mix)]


def test_shutdown_fails_the_requests_of_the_forward_in_flight(tiny_path, _engine_registry):
    """Shut down while a forward runs: its requests fail, and every slot it wrote is freed."""
    engine = Engine(tiny_path, overlap_schedule=True, max_total_tokens=1024)
    _engine_registry.reported.add(engine)  # not clean at its shutdown, by design
    in_forward, release = threading.Event(), threading.Event()
    run = engine.runner.run
    num_forwards = [0]

    def blocking_run(fb):
        num_forwards[0] += 1
        if num_forwards[0] == 3:
            in_forward.set()
            release.wait(30)
        return run(fb)

    engine.runner.run = blocking_run
    abandon, abandoned = engine._abandon_in_flight, []

    def watched_abandon(error):
        abandoned.append(engine._in_flight is not None)
        abandon(error)

    engine._abandon_in_flight = watched_abandon
    params = {"max_new_tokens": 50, "temperature": 0, "ignore_eos": True}
    futures = engine.submit(PROMPTS[:3], params)
    assert in_forward.wait(30)
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    while not engine._stopping:  # the loop is blocked on the forward until it is released
        time.sleep(0.001)
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    assert abandoned == [True]  # shutdown found a forward in flight
    for future in futures:
        assert "shut down" in str(future.exception(timeout=30))
    state = engine.memory_state()
    assert state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
    assert state["kv_slots_locked"] == 0 and state["req_slots_free"] == state["req_slots_total"]


@pytest.mark.parametrize("overlap", [False, True])
def test_prompts_cut_into_chunks_in_the_same_step_all_finish(tiny_path, engines, overlap):
    """Two prompts longer than a prefill chunk, admitted together: one is cut at a time (a
    second one cut in the same step used to fall out of every queue and never finish)."""
    sync, _ = engines
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    prompts = [PROMPTS[4], PROMPTS[7]]
    with Engine(
        tiny_path, chunked_prefill_size=8, max_total_tokens=1024, overlap_schedule=overlap
    ) as engine:
        assert all(len(engine.encode(p)) > 16 for p in prompts)
        got = [f.result(timeout=60) for f in engine.submit(prompts, params)]
    assert [_key(o) for o in got] == [_key(o) for o in sync.generate(prompts, params)]


def _used_and_dropped(tiny_path: str) -> tuple[weakref.ref, threading.Thread, threading.Thread]:
    before = set(threading.enumerate())
    engine = Engine(tiny_path, overlap_schedule=True, max_total_tokens=1024)
    assert len(engine.generate("hello", {"max_new_tokens": 3})["output_ids"]) == 3
    (worker,) = [t for t in set(threading.enumerate()) - before if t is not engine._thread]
    assert worker.name.startswith("lmprog-forward")
    return weakref.ref(engine), engine._thread, worker


def test_an_unreferenced_overlapped_engine_is_collected_with_its_threads(tiny_path):
    gc.collect()
    engine_ref, loop_thread, worker = _used_and_dropped(tiny_path)
    gc.collect()
    loop_thread.join(30)
    worker.join(30)
    assert engine_ref() is None
    assert not loop_thread.is_alive() and not worker.is_alive()
