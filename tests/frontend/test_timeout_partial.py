"""A gen that runs past its `timeout_s` fails its program, and keeps what it generated:
the request's TimeoutError holds its `partial_output`, and the program's variable (and
text) hold that text, as a dataset row's column does. It was lost before: a timed-out
row's gen column was empty."""

from __future__ import annotations

import pytest

import lmprog as lp

GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "Tell a long story:"


@lp.function
def story(s, stop=None):
    s += PROMPT + lp.gen("story", max_tokens=3000, stop=stop, **GREEDY)


# (never generated; a stream holds back its length - 1 characters, which a stop might cut)
STOP = "@@ a stop of twenty @@"


def greedy_prefix(engine, num_tokens: int) -> dict:
    """The uncapped greedy output's first `num_tokens` tokens (the reference)."""
    params = {"max_new_tokens": num_tokens, **GREEDY}
    return engine.generate(PROMPT, params)


def test_the_timeout_error_holds_the_partial_output(engine):
    future = engine.submit(PROMPT, {"max_new_tokens": 3000, "timeout_s": 0.3, **GREEDY})[0]
    with pytest.raises(TimeoutError) as info:
        future.result(timeout=60)
    partial = info.value.partial_output
    assert partial["meta_info"]["finish_reason"]["type"] == "abort"
    ids = partial["output_ids"]
    assert 0 < len(ids) < 3000
    reference = greedy_prefix(engine, len(ids))
    assert ids == reference["output_ids"] and partial["text"] == reference["text"]


@pytest.mark.parametrize("stop", [None, STOP])
@pytest.mark.parametrize("stream", [False, True])
def test_a_timed_out_gen_keeps_its_text_in_the_program(engine, stream, stop):
    """With a stop string a stream holds back the tail it might cut: the text of a gen
    that timed out in a streaming run lacked it (the variable had it)."""
    if stream:
        state = story.run(stop=stop, timeout_s=0.3, stream=True, backend=engine)
        state.sync()
    else:
        (state,) = story.run_batch([{"stop": stop}], timeout_s=0.3, backend=engine)
    assert isinstance(state.error(), TimeoutError)
    text = state["story"]
    assert text and state.text() == PROMPT + text
    partial = state.error().partial_output
    assert text == partial["text"]
    assert text == greedy_prefix(engine, len(partial["output_ids"]))["text"]


def test_a_timed_out_row_keeps_its_gen_column_and_counts_its_tokens(engine):
    """Its usage columns counted the timed-out request as 0 tokens (its error was skipped),
    though its column held what it generated."""
    (row,) = story.map([{}], timeout_s=0.3, include_usage=True, backend=engine)
    assert row["error"].startswith("TimeoutError") and row["story"]
    assert row["prompt_tokens"] == len(engine.encode(PROMPT))
    assert row["completion_tokens"] > 0
    assert greedy_prefix(engine, row["completion_tokens"])["text"] == row["story"]


def test_a_stream_timed_out_before_it_ran_ends_with_the_error_alone(engine, monkeypatch):
    """A timed-out stream gets the last of its text before the error; one that timed out
    while it waited to run has none, and got an empty chunk."""
    import threading

    forward, entered, release = engine.runner.forward, threading.Event(), threading.Event()

    def held_forward(batch):
        if not release.is_set():
            entered.set()
            release.wait(60)
        return forward(batch)

    monkeypatch.setattr(engine.runner, "forward", held_forward)
    busy = engine.submit(PROMPT, {"max_new_tokens": 2})[0]
    assert entered.wait(60)
    chunks = []
    stream = engine.generate(PROMPT, {"max_new_tokens": 4, "timeout_s": 0.05}, stream=True)
    threading.Timer(0.5, release.set).start()
    with pytest.raises(TimeoutError) as info:
        for chunk in stream:
            chunks.append(chunk)
    assert chunks == [] and info.value.partial_output["output_ids"] == []
    busy.result(timeout=60)
