"""A request's own work after the forward (its logprobs recorded, a prefill-only request
finished) fails that request alone, in each of the engine's loops: synchronous,
overlapped and by decode runs. Once it failed the whole step, and in the overlapped loop
every live request, waiting ones included. The others' tokens are checked against the
same engine's fault-free run; the autouse check in conftest finds the engine clean. And a
forward raising a BaseException (not an Exception) fails its step alone, as another
error does, and an error whose message raises fails its request alone."""

from __future__ import annotations

import pytest

from lmprog_runtime import Engine
from lmprog_runtime.request import Req

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = [f"Request {i} says" for i in range(6)]
LOOPS = {"sync": {}, "overlap": {"overlap_schedule": True}, "runs": {"decode_steps": 4}}


@pytest.fixture(scope="module", params=list(LOOPS))
def loop_engine(request, tiny_path):
    # (3 running: the others wait, and the overlapped loop once failed them too)
    with Engine(
        tiny_path, max_total_tokens=4096, max_running_requests=3, **LOOPS[request.param]
    ) as engine:
        clean = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
        yield engine, clean


def _only_the_culprit_fails(futures, clean, message):
    for i, future in enumerate(futures):
        if i == 0:
            with pytest.raises(RuntimeError, match=message):
                future.result(timeout=60)
        else:
            assert future.result(timeout=60)["output_ids"] == clean[i], i


def test_a_token_logprob_that_raises_fails_its_request_alone(loop_engine, monkeypatch):
    """(the text of a logprob's token, `return_text_in_logprobs`, decoded as it comes)"""
    engine, clean = loop_engine
    culprit, entry = engine.encode(PROMPTS[0]), Req.logprob_entry

    def failing(req, logprob, token):
        if req.input_ids == culprit and len(req.output_token_logprobs) == 3:
            raise RuntimeError("injected in a logprob")
        return entry(req, logprob, token)

    monkeypatch.setattr(Req, "logprob_entry", failing)
    futures = engine.submit(
        PROMPTS,
        GREEDY,
        return_logprob=[True] * len(PROMPTS),
        return_text_in_logprobs=[True] + [False] * (len(PROMPTS) - 1),
    )
    _only_the_culprit_fails(futures, clean, "injected in a logprob")


def test_a_prefill_only_request_whose_finish_raises_fails_alone(loop_engine, monkeypatch):
    """(`max_new_tokens=0`: its pattern's check, its prompt logprobs' end)"""
    engine, clean = loop_engine
    culprit, finish = engine.encode(PROMPTS[0]), Req.finish_prefill_only

    def failing(req):
        if req.input_ids == culprit:
            raise RuntimeError("injected in a prefill-only finish")
        return finish(req)

    monkeypatch.setattr(Req, "finish_prefill_only", failing)
    params = [{**GREEDY, "max_new_tokens": 0}] + [GREEDY] * (len(PROMPTS) - 1)
    # (submitted together: the culprit's extend is the others' first step)
    futures = engine.submit(PROMPTS, params)
    _only_the_culprit_fails(futures, clean, "injected in a prefill-only finish")


class Boom(BaseException):
    """(not an Exception: what the model's own code could raise, SystemExit as one)"""


def test_a_forward_raising_a_base_exception_fails_its_step_and_frees_it(loop_engine):
    """A BaseException from a forward was left to the loop's last resort: every live
    request failed, the requests waiting included, and the step's slots were lost for
    good. Now that step's requests fail (their slots freed), the rest run."""
    engine, clean = loop_engine
    culprit = engine.encode(PROMPTS[0])
    once = []

    def hook(point, req):
        if point == "forward" and req.input_ids == culprit and not once:
            once.append(req)
            raise Boom("injected, not an Exception")

    engine.fault_hook = hook
    try:
        futures = engine.submit(PROMPTS, GREEDY)
        failed = 0
        for i, future in enumerate(futures):
            try:
                assert future.result(timeout=60)["output_ids"] == clean[i], i
            except RuntimeError as error:
                assert "injected, not an Exception" in str(error)
                failed += 1
        assert 1 <= failed <= 3  # (its step's: 3 run at once, the others waited)
    finally:
        engine.fault_hook = None
    assert engine.generate(PROMPTS[0], GREEDY)["output_ids"] == clean[0]


class Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no message")


@pytest.mark.parametrize("point", ["schedule", "forward", "sample"])
def test_an_error_whose_message_raises_still_fails_its_request_alone(loop_engine, point):
    """Finishing a request read its error's message after it had left the engine's
    tables: one that raised there left its caller waiting for ever (at admission, its
    slots held too), and at a forward or a draw failed the step's other requests."""
    engine, clean = loop_engine
    culprit = engine.encode(PROMPTS[0])

    def hook(at, req):
        if at == point and req.input_ids == culprit:
            raise Unprintable()

    engine.fault_hook = hook
    try:
        futures = engine.submit(PROMPTS, GREEDY)
        _only_the_culprit_fails(futures, clean, "Unprintable \\(its message could not be read")
    finally:
        engine.fault_hook = None


def test_a_decode_steps_draw_that_raises_frees_its_requests_slots_once(loop_engine, monkeypatch):
    """A step that fails whole after its K/V were counted (here its draw, queued or run)
    must not count them again: once a decode step's were, and the finish freed a table
    entry past each request's tokens (slot 0, or a slot another request or the prefix
    cache held). The step's requests fail; the engine, clean, serves the same tokens."""
    from lmprog_runtime.step_draw import StepDraw

    engine, clean = loop_engine
    if engine.config.decode_steps != 1:
        pytest.skip("a decode run draws inside its forward (`run_commit` takes its tokens)")
    calls = []

    def failing(real):
        def draw(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # (a decode step's: the first is the prefill's)
                raise RuntimeError("injected in a step's draw")
            return real(*args, **kwargs)

        return draw

    if engine._worker is not None:
        monkeypatch.setattr(engine._worker, "sample", failing(engine._worker.sample))
    else:
        monkeypatch.setattr(StepDraw, "_draw", failing(StepDraw._draw))
    engine.flush_cache()
    futures = engine.submit(PROMPTS[:3], GREEDY)
    failed = [f.exception(timeout=60) for f in futures]
    assert any(failed) and all("injected" in str(e) for e in failed if e), failed
    monkeypatch.undo()
    again = engine.generate(PROMPTS, GREEDY)
    assert [o["output_ids"] for o in again] == clean
