"""`Engine.submit` (futures, streamed chunks through a callback, the caller's lists its own
again) and `stop_regex`, on the tiny model; references: transformers' greedy tokens, the
engine's own blocking `generate`, and `re.search` over the unstopped output."""

from __future__ import annotations

import re
import threading

import pytest
from helpers import PROMPTS, hf_greedy


def test_submit_returns_futures_with_transformers_greedy_tokens(engine, hf_tiny):
    params = {"max_new_tokens": 12, "temperature": 0}
    chunks: dict[int, list[str]] = {}
    threads: set[str] = set()

    def on_chunk(i: int, chunk: dict) -> None:
        threads.add(threading.current_thread().name)
        chunks.setdefault(i, []).append(chunk["text"])

    futures = engine.submit(PROMPTS[:4], params, on_chunk=on_chunk)
    outs = [f.result(timeout=120) for f in futures]
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out["output_ids"] == hf_greedy(hf_tiny, prompt, 12), prompt
        assert "".join(chunks[i]) == out["text"]  # the chunks concatenate to the text
        assert out["meta_info"]["id"] != outs[i - 1]["meta_info"]["id"]
    assert threads == {"lmprog-engine"}  # callbacks run on the loop thread


def test_submit_refuses_bad_input_before_submitting_anything(engine):
    engine.reset_stats()
    too_long = [5] * (engine.context_len + 1)
    with pytest.raises(ValueError, match="longer than the context"):
        engine.submit(input_ids=[[5, 6, 7], too_long], sampling_params={"max_new_tokens": 2})
    with pytest.raises(ValueError, match="temperature"):
        engine.submit("hi", {"temperature": float("nan")})
    assert engine.stats()["forward_passes"] == 0  # the good prompt was not sent either


def test_the_callers_input_ids_lists_may_change_once_submitted(tiny_path):
    """The engine keeps its own copy (`GenerateItem`): a request that waits (two run at a
    time) computes the prompt it was given, not what the caller's list holds by then (and
    a waiting request's prefix match resumes on the tokens it matched before)."""
    import lmprog as lp

    prompts = [[5 + (7 * i + j) % 90 for j in range(12)] for i in range(8)]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with lp.Engine(tiny_path, max_running_requests=2) as alone:
        expected = [
            out["output_ids"] for out in alone.generate(input_ids=prompts, sampling_params=params)
        ]
        given = [ids[:] for ids in prompts]
        futures = alone.submit(input_ids=given, sampling_params=params)
        for ids in given:
            ids[:] = [3] * len(ids)
        assert [f.result(timeout=120)["output_ids"] for f in futures] == expected


def test_a_failing_callback_does_not_fail_the_other_requests(engine):
    def bad(i: int, chunk: dict) -> None:
        raise RuntimeError("a caller's bug")

    params = {"max_new_tokens": 6, "temperature": 0}
    failing = engine.submit(PROMPTS[:2], params, on_chunk=bad)
    fine = engine.submit(PROMPTS[2:4], params)
    for future, prompt in zip(failing + fine, PROMPTS[:4]):
        assert (
            future.result(timeout=120)["output_ids"]
            == engine.generate(prompt, params)["output_ids"]
        )


@pytest.mark.parametrize("error", [SystemExit, KeyboardInterrupt, GeneratorExit])
def test_a_callback_raising_a_base_exception_does_not_stop_the_engine(engine, error):
    """`sys.exit()` in a callback (a stream's, or a future's done-callback) once ended the
    loop thread: every request then waited forever, and later ones were still accepted."""

    def bad_chunk(i: int, chunk: dict) -> None:
        raise error

    def bad_done(future) -> None:
        raise error

    params = {"max_new_tokens": 6, "temperature": 0}
    failing = engine.submit(PROMPTS[:1], params, on_chunk=bad_chunk)
    done_failing = engine.submit(PROMPTS[1:2], params)
    done_failing[0].add_done_callback(bad_done)
    fine = engine.submit(PROMPTS[2:3], params)
    for future, prompt in zip(failing + done_failing + fine, PROMPTS[:3]):
        expected = engine.generate(prompt, params)["output_ids"]
        assert future.result(timeout=120)["output_ids"] == expected
    assert engine._thread.is_alive()


def test_shutdown_from_a_callback_is_refused_and_changes_nothing(engine):
    """A callback runs on the loop thread, which cannot join itself: `shutdown()` there
    once stopped the loop half-way, its requests never resolved and their slots held."""
    refused: list[BaseException] = []

    def shut(i: int, chunk: dict) -> None:
        try:
            engine.shutdown()
        except RuntimeError as error:
            refused.append(error)

    params = {"max_new_tokens": 6, "temperature": 0}
    futures = engine.submit(PROMPTS[:1], params, on_chunk=shut) + engine.submit(
        PROMPTS[1:2], params
    )
    for future, prompt in zip(futures, PROMPTS[:2]):
        assert (
            future.result(timeout=120)["output_ids"]
            == engine.generate(prompt, params)["output_ids"]
        )
    assert refused and "own loop thread" in str(refused[0])
    assert engine._thread.is_alive() and not engine._stopping


@pytest.mark.parametrize("call", ["generate", "flush_cache", "result", "exception", "stream"])
def test_a_blocking_call_from_a_callback_is_refused_and_nothing_hangs(engine, call):
    """A callback that waited on the engine (for a generate, a command, another request's
    future, a stream) waited for the loop thread that ran it: every request of the engine
    hung, later ones too. Now it is refused at once, and the others run on."""
    params = {"max_new_tokens": 6, "temperature": 0}
    other = engine.submit(PROMPTS[2:3], {**params, "max_new_tokens": 64})[0]
    refused: list[BaseException] = []

    def wait_in_callback(i: int, chunk: dict) -> None:
        if refused:
            return
        try:
            if call == "generate":
                engine.generate(PROMPTS[3], params)
            elif call == "flush_cache":
                engine.flush_cache()
            elif call == "stream":
                next(iter(engine.generate(PROMPTS[3], params, stream=True)))
            else:
                getattr(other, call)()
        except RuntimeError as error:
            refused.append(error)

    futures = engine.submit(PROMPTS[:2], params, on_chunk=wait_in_callback)
    for future, prompt in zip(futures, PROMPTS[:2]):
        expected = engine.generate(prompt, params)["output_ids"]
        assert future.result(timeout=60)["output_ids"] == expected
    assert other.result(timeout=60)["output_ids"]
    assert refused and "engine's own loop thread" in str(refused[0]), refused


@pytest.mark.parametrize(
    "pattern", [r"[A-Z]\w", r"\d", r"[aeiou]{2}", r"qu?i", r"(?i)qu", r"\bth", r"e\W"]
)
def test_stop_regex_cuts_at_the_first_match_of_the_unstopped_output(engine, pattern):
    base = {"max_new_tokens": 40, "temperature": 0}
    for prompt in PROMPTS[:6]:
        full = engine.generate(prompt, base)
        stopped = engine.generate(prompt, {**base, "stop_regex": pattern})
        found = re.search(pattern, full["text"])
        if found is None:
            assert stopped["text"] == full["text"]
            continue
        assert stopped["text"] == full["text"][: found.start()]
        reason = stopped["meta_info"]["finish_reason"]
        assert reason["type"] == "stop" and re.fullmatch(pattern, reason["matched"])
        # it stopped at the token that completed the match, not later
        assert len(stopped["output_ids"]) <= len(full["output_ids"])
        assert stopped["output_ids"] == full["output_ids"][: len(stopped["output_ids"])]
        streamed = "".join(
            c["text"] for c in engine.generate(prompt, {**base, "stop_regex": pattern}, stream=True)
        )
        assert streamed == stopped["text"]  # never streams text a match would take back


def test_a_stop_regex_stream_releases_text_no_match_can_begin_in(engine):
    """Text is held back only from where a match could still begin, not all of it."""
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "stop_regex": "QQ!"}
    chunks = [c["text"] for c in engine.generate(PROMPTS[0], params, stream=True)]
    full = engine.generate(PROMPTS[0], {k: v for k, v in params.items() if k != "stop_regex"})
    assert "".join(chunks) == full["text"]
    assert sum(1 for c in chunks if c) > 5  # streamed as it went, not in one piece at the end


def test_stop_regex_is_checked_at_submit(engine):
    with pytest.raises(ValueError, match="not a valid regex"):
        engine.generate("hi", {"stop_regex": "("})
    with pytest.raises(ValueError, match="empty string"):
        engine.generate("hi", {"stop_regex": "a*"})
    with pytest.raises(TypeError, match="stop_regex"):
        engine.generate("hi", {"stop_regex": [3]})


def test_a_stop_regex_search_out_of_time_fails_its_request_alone(engine, monkeypatch):
    """An anchored pattern is searched by a backtracking engine, within a time limit: one
    past it fails its own request, naming the pattern (`(x+x+)+y$` once held the loop, and
    every request, for minutes). The limit is made tiny here to stand for such a pattern."""
    import lmprog_runtime.stop_regex as stop_regex

    monkeypatch.setattr(stop_regex, "SEARCH_TIMEOUT_S", 1e-7)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    futures = engine.submit(PROMPTS[:2], [{**params, "stop_regex": r"(?<=q)(x+x+)+y"}, params])
    with pytest.raises(RuntimeError, match=r"stop_regex .* took over 1e-07 s"):
        futures[0].result(timeout=60)
    assert len(futures[1].result(timeout=60)["output_ids"]) == 12


def test_a_streamed_request_whose_last_chunk_fails_fails_alone(engine, monkeypatch):
    """The last chunk is made as the request is announced: its failure failed the whole
    step, every request finishing with it; now only its own."""
    from lmprog_runtime.request import Req

    chunk, doomed = Req.stream_delta, len(engine.encode("hi"))

    def failing_last(self):
        if self.is_finished and self.prompt_len == doomed:
            raise ValueError("the last chunk failed")
        return chunk(self)

    monkeypatch.setattr(Req, "stream_delta", failing_last)
    params = {"max_new_tokens": 3, "ignore_eos": True}
    futures = engine.submit(["hi", "hello there, friend"], params, on_chunk=lambda i, c: None)
    with pytest.raises(RuntimeError, match="the last chunk failed"):
        futures[0].result(timeout=60)
    assert len(futures[1].result(timeout=60)["output_ids"]) == 3


def test_a_callback_may_poll_a_pending_future(engine):
    """A poll (`timeout=0`) does not wait: in a callback it raises TimeoutError, as
    anywhere, rather than the refusal of a wait."""
    import concurrent.futures

    params = {"max_new_tokens": 6, "temperature": 0}
    other = engine.submit(PROMPTS[2:3], {**params, "max_new_tokens": 64})[0]
    seen: list[BaseException] = []

    def poll(i: int, chunk: dict) -> None:
        if not seen and not other.done():
            try:
                other.result(timeout=0)
            except BaseException as error:  # noqa: BLE001 - recorded, checked below
                seen.append(error)

    engine.submit(PROMPTS[:1], params, on_chunk=poll)[0].result(timeout=60)
    other.result(timeout=60)
    assert seen and isinstance(seen[0], concurrent.futures.TimeoutError), seen
