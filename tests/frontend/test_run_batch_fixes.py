"""`run_batch` and `map` options: a `num_threads` of the wrong type is a TypeError naming it
(a bad count stays a ValueError), and the progress bar prints its 100% line once."""

from __future__ import annotations

import time

import pytest

import lmprog as lp

# Longer than tqdm's `mininterval` (0.1 s).
SLOWER_THAN_A_REFRESH_S = 0.15


@lp.function
def echo(s, question):
    """No request: its state is known without a model."""
    s += question
    return question.upper()


@pytest.mark.parametrize("num_threads", [1.5, "8", True, None, [4]])
@pytest.mark.parametrize("method", ["run_batch", "map"])
def test_a_num_threads_of_the_wrong_type_is_a_type_error(engine, method, num_threads):
    with pytest.raises(TypeError, match="num_threads"):
        getattr(echo, method)([{"question": "a"}], num_threads=num_threads, backend=engine)


@pytest.mark.parametrize("num_threads", [0, -1])
@pytest.mark.parametrize("method", ["run_batch", "map"])
def test_a_num_threads_below_one_is_a_value_error(engine, method, num_threads):
    with pytest.raises(ValueError, match="num_threads"):
        getattr(echo, method)([{"question": "a"}], num_threads=num_threads, backend=engine)


@lp.function
def slow_echo(s, question):
    """Each program outlasts a refresh interval: every update finds the bar due one."""
    time.sleep(SLOWER_THAN_A_REFRESH_S)
    s += question


@pytest.mark.parametrize("generator_style", [True, False])
def test_the_progress_bar_prints_its_final_line_once(engine, capsys, generator_style):
    items = [{"question": f"q{i}"} for i in range(3)]
    capsys.readouterr()
    states = slow_echo.run_batch(
        items, num_threads=1, progress_bar=True, generator_style=generator_style, backend=engine
    )
    texts = [state.text() for state in states]
    err = capsys.readouterr().err
    # Each display of the bar starts with "\r"; the last one, and only it, shows 100%.
    displays = [d for d in err.split("\r") if d.strip()]
    assert [d for d in displays if "100%" in d] == [displays[-1]], displays
    assert "3/3" in displays[-1] and displays[-1].endswith("\n")
    assert sorted(texts) == sorted(item["question"] for item in items)


def test_ctrl_c_reaches_the_caller_while_bodies_are_busy_with_work_of_their_own(engine):
    """The batch's pool was left by `with`, which waited for every thread: a body in a
    tool call (here, waiting on an event) held the Ctrl-C back until it returned."""
    import signal
    import threading

    busy, release, returned = threading.Barrier(3, timeout=60), threading.Event(), []

    @lp.function
    def tool_call(s, i):
        s += f"Row {i}:" + lp.gen("x", max_tokens=2, temperature=0)
        s["x"]  # noqa: B018
        busy.wait()
        release.wait(timeout=30)
        returned.append(i)
        s += lp.gen("y", max_tokens=2)

    main = threading.main_thread().ident
    timer = threading.Thread(target=lambda: (busy.wait(), signal.pthread_kill(main, signal.SIGINT)))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            tool_call.run_batch([{"i": 0}, {"i": 1}], num_threads=2, backend=engine)
        assert not returned  # (raised while the bodies still wait)
    finally:
        release.set()
        timer.join()
    # The cancelled programs end on their own threads once their bodies read again.
    deadline = time.monotonic() + 60
    while any(t.name.startswith("lmprog-program") for t in threading.enumerate()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
