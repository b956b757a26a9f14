"""A program run, or a read of its state, from a callback on the engine's loop thread (a
future's done callback, `on_chunk`) waited for the loop that runs the callback: the
program and every other request of the engine hung. It is refused at once, before
anything is sent, and the engine goes on. Reference: the same program run afterwards from
the test's own thread, and `Engine.generate` on the other request's prompt."""

from __future__ import annotations

import threading

import pytest

import lmprog as lp


@lp.function
def hello(s):
    s += "Hello," + lp.gen("x", max_tokens=4, temperature=0)


def _from_a_callback(engine, call) -> BaseException | None:
    """Run `call()` in a done callback of a request; its outcome once the callback ran."""
    outcome: list[BaseException | None] = []
    ran = threading.Event()

    def callback(_future) -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as error:  # noqa: BLE001 - the outcome is the test's subject
            outcome.append(error)
        ran.set()

    future = engine.submit(["Hi"], {"max_new_tokens": 2})[0]
    future.add_done_callback(callback)
    assert ran.wait(60), "the callback never finished: it waited on the loop thread"
    return outcome[0]


@pytest.mark.parametrize("how", ["run", "run_batch", "generator", "map", "stream_read"])
def test_a_program_waiting_in_a_callback_is_refused_and_nothing_hangs(engine, how):
    streamed: list[lp.ProgramState] = []

    def call() -> None:
        if how == "run":
            hello.run(backend=engine)
        elif how == "run_batch":
            hello.run_batch([{}, {}], backend=engine)
        elif how == "generator":
            next(hello.run_batch([{}], backend=engine, generator_style=True))
        elif how == "map":
            list(hello.map([{}], backend=engine))
        else:
            streamed.append(hello.run(backend=engine, stream=True))  # (no wait: fine)
            streamed[0]["x"]

    error = _from_a_callback(engine, call)
    assert isinstance(error, RuntimeError), error
    assert "engine's own loop thread" in str(error)
    if streamed:  # the streaming run itself goes on, and ends as it would have
        assert streamed[0]["x"] == hello.run(backend=engine)["x"]
    # The engine runs on: the program from this thread, and a request beside it.
    prompt = engine.encode("Hello,")
    expected = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    assert hello.run(backend=engine)["x"] == expected["text"]
