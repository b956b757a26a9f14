"""One request never harms another: faults stay with their request, requests can be
aborted, time out or be dropped, and the queue is bounded (issue 14).

Every test ends with the engine clean (the autouse check in conftest): no KV or request
slot held, nothing running or waiting.
"""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
from conftest import engine_leak

import lmprog as lp
from lmprog_runtime import Engine, QueueFull, RequestAborted

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"The number {i} is" for i in range(8)]


@pytest.fixture(scope="module")
def clean(tiny_path):
    """Each prompt's greedy and seeded outputs, one request at a time on a fresh engine."""
    with Engine(tiny_path, max_total_tokens=4096) as engine:
        greedy = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        seeded = [engine.generate(p, _seeded(i))["output_ids"] for i, p in enumerate(PROMPTS)]
    return greedy, seeded


def _seeded(i: int) -> dict:
    return {"max_new_tokens": 12, "temperature": 0.9, "seed": 100 + i, "ignore_eos": True}


def _fail_when(point: str, engine: Engine, prompt: str):
    ids = engine.encode(prompt)

    def hook(at: str, req) -> None:
        if at == point and req.input_ids == ids:
            raise RuntimeError(f"injected at {point}")

    return hook


# ("cache": once the step's other requests, already counted, had their K/V counted again
# by the failed step, and their frees took slots the prefix cache held: later outputs
# served from the cache were wrong)
@pytest.mark.parametrize("point", ["sample", "schedule", "forward", "cache"])
def test_a_fault_fails_its_request_and_the_others_are_token_identical(engine, clean, point):
    greedy, seeded = clean
    engine.fault_hook = _fail_when(point, engine, PROMPTS[3])
    try:
        futures = engine.submit(PROMPTS, GREEDY)
        seeded_futures = engine.submit(PROMPTS, [_seeded(i) for i in range(len(PROMPTS))])
        for i, (future, other) in enumerate(zip(futures, seeded_futures)):
            if i == 3:
                for failed in (future, other):
                    with pytest.raises(RuntimeError, match=f"injected at {point}"):
                        failed.result(timeout=60)
                continue
            assert future.result(timeout=60)["output_ids"] == greedy[i]
            assert other.result(timeout=60)["output_ids"] == seeded[i]
    finally:
        engine.fault_hook = None
    assert engine._thread.is_alive()
    assert engine.generate(PROMPTS[3], GREEDY)["output_ids"] == greedy[3]
    again = engine.generate(PROMPTS, GREEDY)  # (their prefixes from the cache now)
    assert [out["output_ids"] for out in again] == greedy


def test_a_group_whose_admission_raises_fails_alone(engine, clean):
    """A fork's members are claimed together: one raising at admission fails its group,
    once each, and the group queued beside it runs as it would have."""
    greedy, _ = clean
    engine.fault_hook = _fail_when("schedule", engine, PROMPTS[1])
    try:
        failing = engine.submit(PROMPTS[:4], GREEDY, group=True)
        fine = engine.submit(PROMPTS[4:], GREEDY, group=True)
        for future in failing:
            with pytest.raises(RuntimeError, match="injected at schedule"):
                future.result(timeout=60)
        for i, future in enumerate(fine, start=4):
            assert future.result(timeout=60)["output_ids"] == greedy[i]
    finally:
        engine.fault_hook = None
    assert engine._thread.is_alive()


def test_a_forward_fault_in_a_mixed_batch_on_pages_fails_one_request(tiny_path, clean):
    """A request that makes the forward raise, admitted while others decode (a mixed
    extend + decode forward), on pages of 4 slots: it fails, the others finish exactly as
    they would have, and its slots are freed (the autouse check)."""
    greedy, _ = clean
    culprit = PROMPTS[3]
    with Engine(tiny_path, max_total_tokens=4096, page_size=4) as engine:
        culprit_ids = engine.encode(culprit)
        mixed = []  # decoding requests in the forwards that carried the culprit
        forward = engine._forward

        def watched(batch):
            if any(r.input_ids == culprit_ids for r in batch.reqs):
                mixed.append(batch.num_decodes)
            return forward(batch)

        engine._forward = watched
        engine.fault_hook = _fail_when("forward", engine, culprit)
        decoding = threading.Event()
        try:
            early = engine.submit(PROMPTS[:3], LONG, on_chunk=lambda i, c: decoding.set())
            assert decoding.wait(60)
            late = engine.submit(PROMPTS[3:], GREEDY)
            with pytest.raises(RuntimeError, match="injected at forward"):
                late[0].result(timeout=60)
            for i, future in enumerate(late[1:], start=4):
                assert future.result(timeout=60)["output_ids"] == greedy[i], i
            for i, future in enumerate(early):
                assert future.result(timeout=120)["output_ids"][:12] == greedy[i], i
        finally:
            engine.fault_hook = None
            del engine._forward
        assert max(mixed, default=0) > 0, mixed  # the culprit shared a forward with decodes


def test_scheduling_that_raises_orphans_nothing_and_does_not_spin(tiny_path, monkeypatch):
    """An error after the scheduler took requests off its waiting list (building the batch)
    fails those requests; an error that repeats fails what the loop holds instead of spinning."""
    with Engine(tiny_path, max_total_tokens=2048) as engine:
        real = engine.scheduler._alloc_extend
        calls = [0]

        def broken_once(entries):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("allocation bug")
            return real(entries)

        monkeypatch.setattr(engine.scheduler, "_alloc_extend", broken_once)
        futures = engine.submit(PROMPTS[:3], GREEDY)
        errors = [f.exception(timeout=60) for f in futures]
        assert all(e is not None and "allocation bug" in str(e) for e in errors)
        assert len(engine.generate("works again", GREEDY)["output_ids"]) == 12

        def always_broken(entries):
            raise RuntimeError("permanent bug")

        monkeypatch.setattr(engine.scheduler, "_alloc_extend", always_broken)
        future = engine.submit("never admitted", GREEDY)[0]
        with pytest.raises(RuntimeError, match="permanent bug"):
            future.result(timeout=60)
        assert engine._thread.is_alive()
        monkeypatch.setattr(engine.scheduler, "_alloc_extend", real)
        assert len(engine.generate("and again", GREEDY)["output_ids"]) == 12


def test_abort_a_running_and_a_waiting_request(tiny_path):
    with Engine(tiny_path, max_total_tokens=4096, max_running_requests=1) as engine:
        running, waiting = engine.submit(["a long story", "never started"], LONG)
        engine.abort(waiting.request_id)
        with pytest.raises(RequestAborted, match=f"request {waiting.request_id}"):
            waiting.result(timeout=60)
        engine.abort(running.request_id)
        with pytest.raises(RequestAborted):
            running.result(timeout=60)
        engine.abort(running.request_id)  # already finished: ignored
        engine.abort(10**9)  # unknown: ignored
        with pytest.raises(TypeError, match="request_id"):
            engine.abort("1")
        # What it computed stays in the prefix cache.
        again = engine.generate("a long story", {"max_new_tokens": 1})
        assert again["meta_info"]["cached_tokens"] > 0


def test_meta_info_carries_the_id_abort_takes(engine):
    out = engine.generate("hello", {"max_new_tokens": 2})
    future = engine.submit("hello", {"max_new_tokens": 2})[0]
    assert future.result(timeout=60)["meta_info"]["id"] == future.request_id
    assert isinstance(out["meta_info"]["id"], int)


def test_timeout_s_fails_the_request_with_timeout_error(engine):
    with pytest.raises(TimeoutError, match="timeout_s=0.05"):
        engine.generate("slow", {**LONG, "timeout_s": 0.05})
    assert len(engine.generate("fast", {**GREEDY, "timeout_s": 60})["output_ids"]) == 12


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_bad_timeout_s_is_a_value_error(engine, value):
    with pytest.raises(ValueError, match="timeout_s"):
        engine.generate("x", {"timeout_s": value})
    with pytest.raises(TypeError, match="timeout_s"):
        engine.generate("x", {"timeout_s": "1"})


def test_closing_a_stream_aborts_its_request(engine):
    engine.reset_stats()
    stream = engine.generate("tell me everything", LONG, stream=True)
    first = next(stream)
    assert first["meta_info"]["completion_tokens"] >= 1
    stream.close()
    with pytest.raises(StopIteration):
        next(stream)
    assert _tokens_after_settling(engine) < 1900  # of the 2000 it would make


def test_dropping_a_stream_aborts_its_request(engine):
    engine.reset_stats()
    stream = engine.generate("tell me everything", LONG, stream=True)
    next(stream)
    del stream
    assert _tokens_after_settling(engine) < 1900


def test_the_queue_is_bounded(tiny_path):
    with pytest.raises(ValueError, match="max_queued_requests"):
        Engine(tiny_path, max_queued_requests=0)
    with Engine(tiny_path, max_total_tokens=2048, max_queued_requests=4) as engine:
        with pytest.raises(QueueFull, match="max_queued_requests=4"):
            engine.submit(["x"] * 5, GREEDY)
        outs = engine.generate(["x"] * 4, GREEDY)  # at the limit: accepted
        assert len(outs) == 4
        # A group's internal prefill of the prompts' shared prefix is not counted (four
        # grouped prompts were refused).
        shared = ["the same long prefix of tokens " * 4 + str(i) for i in range(4)]
        futures = engine.submit(shared, GREEDY, group=True)
        assert len([f.result() for f in futures]) == 4


def _interrupt_main_after(seconds: float) -> threading.Timer:
    """Ctrl-C as a terminal sends it: a real SIGINT to the main thread, which interrupts a
    blocking wait there (`_thread.interrupt_main` would wait for the wait to end)."""
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def _tokens_after_settling(engine: Engine) -> float:
    assert engine_leak(engine) is None
    return engine.stats()["decode_tokens"] + engine.stats()["prefill_tokens"]


def test_ctrl_c_in_generate_aborts_its_requests(engine):
    engine.reset_stats()
    timer = _interrupt_main_after(0.3)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(["one", "two"], LONG)
    timer.join()
    assert _tokens_after_settling(engine) < 2000  # of the 4000 the two would make


@lp.function
def _two_long_gens(s, topic):
    s += f"About {topic}:" + lp.gen("a", max_tokens=1000, ignore_eos=True)
    s += " And:" + lp.gen("b", max_tokens=1000, ignore_eos=True)


def test_ctrl_c_in_run_cancels_the_program(engine):
    engine.reset_stats()
    timer = _interrupt_main_after(0.1)
    with pytest.raises(KeyboardInterrupt):
        _two_long_gens.run(topic="cats", backend=engine)
    timer.join()
    assert _tokens_after_settling(engine) < 1900  # of the 2000 it would make


def test_ctrl_c_in_run_batch_cancels_every_program(engine):
    engine.reset_stats()
    timer = _interrupt_main_after(0.5)
    with pytest.raises(KeyboardInterrupt):
        _two_long_gens.run_batch([{"topic": str(i)} for i in range(20)], backend=engine)
    timer.join()
    assert _tokens_after_settling(engine) < 20_000  # of the 40,000 the batch would make


def test_closing_a_run_batch_generator_cancels_the_programs_still_running(engine):
    """Nobody can read the programs a closed `generator_style` batch still ran: closing it
    waited for all of them (as breaking out of `map` does not)."""

    @lp.function
    def short_or_long(s, n):
        s += f"{n}:" + lp.gen("a", max_tokens=n, ignore_eos=True)

    engine.reset_stats()
    lengths = [4] + [1000] * 8
    states = short_or_long.run_batch(
        [{"n": n} for n in lengths], backend=engine, generator_style=True, num_threads=9
    )
    first = next(states)
    states.close()
    assert first.error() is None and len(first["a"]) > 0
    assert _tokens_after_settling(engine) < 4000  # of the 8000 the long ones would make


def test_a_cancelled_async_reader_leaves_the_program_to_its_other_readers(engine):
    """A `wait_for` timeout on one chunk cancels that reader as a task cancel would: the
    program goes on, and another reader gets all of its text."""

    @lp.function
    def story(s):
        s += "Once:" + lp.gen("a", max_tokens=200, ignore_eos=True, temperature=0)

    state = story.run(backend=engine, stream=True)

    async def main() -> str:
        impatient = state.text_async_iter()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(impatient.__anext__(), 1e-6)
        return "".join([delta async for delta in state.text_async_iter()])

    text = asyncio.run(main())
    assert state.error() is None and text == state.text()
    assert state.get_meta_info("a")["completion_tokens"] == 200  # all of it was made


def test_a_loop_iteration_that_raises_fails_its_requests_and_the_loop_goes_on(
    tiny_path, monkeypatch
):
    with Engine(tiny_path, max_total_tokens=2048) as engine:
        real = engine._cancel

        def broken(aborts):
            raise RuntimeError("loop bug")

        monkeypatch.setattr(engine, "_cancel", broken)
        future = engine.submit("hello", GREEDY)[0]
        with pytest.raises(RuntimeError, match="loop bug"):
            future.result(timeout=60)
        monkeypatch.setattr(engine, "_cancel", real)
        assert engine._thread.is_alive()
        assert len(engine.generate("hello", GREEDY)["output_ids"]) == 12


def test_deadlines_fire_among_many_and_finished_ones_are_let_go(engine):
    """Requests with deadlines far off and near, in one batch: the near ones time out, the
    others finish; the loop keeps no entry of a finished request for long (it looks at
    the nearest deadline each step, not at every request that has one)."""
    near, far = {**LONG, "timeout_s": 0.05}, {**GREEDY, "timeout_s": 3600}
    futures = engine.submit(["slow"] * 2 + ["fast"] * 2, [near, near, far, far])
    assert all(isinstance(f.exception(timeout=60), TimeoutError) for f in futures[:2])
    assert all(len(f.result(timeout=60)["output_ids"]) == 12 for f in futures[2:])
    engine.generate(["fast"] * 150, far)
    engine.generate("fast", GREEDY)  # (an iteration after those finished)
    assert len(engine._deadlines) <= 64


def test_a_batch_wakes_its_caller_once_and_at_once_for_a_failure(engine):
    """`generate` of a batch waits for all of it or for one failure, not request by
    request: the first request failing at its first forward is raised while the others
    still run (and they are aborted then), and every request is told on the loop thread
    before the caller wakes."""
    from lmprog_runtime.results import wake_once

    class Done:
        error = None

    reqs = [Done() for _ in range(3)]
    woken = wake_once(reqs)
    reqs[0].on_done(reqs[0])
    reqs[2].on_done(reqs[2])
    assert not woken.is_set()
    reqs[1].on_done(reqs[1])
    assert woken.is_set()

    first = engine.encode("doomed")

    def hook(point, req):
        if point == "forward" and req.input_ids == first:
            raise RuntimeError("this request fails at its first forward")

    engine.reset_stats()
    engine.fault_hook = hook
    try:
        with pytest.raises(RuntimeError, match="first forward"):
            engine.generate(["doomed", "slow", "slower"], LONG)
    finally:
        engine.fault_hook = None
    assert engine.stats()["forward_passes"] < LONG["max_new_tokens"]  # the others aborted


def test_a_text_that_fails_to_decode_fails_its_request_alone(engine, clean, monkeypatch):
    """The requests a step stops have their texts decoded together before they finish: one
    whose decode raises fails, and the others of its step get their own text."""
    from lmprog_runtime.request import Req

    culprit = engine.encode(PROMPTS[3])
    visible_text = Req._visible_text

    def failing(req):
        if req.input_ids == culprit:
            raise RuntimeError("injected in the decode")
        return visible_text(req)

    monkeypatch.setattr(Req, "_visible_text", failing)
    futures = engine.submit(PROMPTS, GREEDY)  # (all stop at the same step, by length)
    for i, future in enumerate(futures):
        if i == 3:
            with pytest.raises(RuntimeError, match="injected in the decode"):
                future.result(timeout=60)
            continue
        out = future.result(timeout=60)
        assert out["output_ids"] == clean[0][i]
        assert out["text"] == engine.decode(out["output_ids"])
