"""A pattern that compiles slowly holds up only the program that wrote it.

Every program in a process shares one interpreter thread, which submits their requests;
a gen's `regex` / `json_schema` compiles at its submit (seconds for a large schema, up to
`grammar_compile_timeout_s` for one that explodes). That thread waited for the compile,
so every other program stopped meanwhile, and `cancel()` of the waiting program took
effect only once the compile ended. The compile is held here until the test releases it.
"""

from __future__ import annotations

import re
import threading

import pytest
from conftest import engine_leak

import lmprog as lp

WAIT_S = 60


@lp.function
def constrained(s, pattern):
    s += "Code:" + lp.gen("code", regex=pattern, max_tokens=300, temperature=0)


@lp.function
def plain(s, i):
    s += f"Story {i}:" + lp.gen("story", max_tokens=6, temperature=0, ignore_eos=True)


def submitted(name: str = "lmprog-submit") -> None:
    """Wait until no request is still being submitted (its compile done)."""
    for thread in threading.enumerate():
        if thread.name == name:
            thread.join(WAIT_S)


def test_other_programs_run_while_a_pattern_compiles(engine, held):
    slow = constrained.run(pattern="held[g-i]{3}", stream=True, backend=engine)
    assert held.started.wait(WAIT_S)
    states = plain.run_batch([{"i": i} for i in range(4)], backend=engine)
    assert not held.ended.is_set()  # (they ran while the compile was held)
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    for i, state in enumerate(states):
        assert state["story"] == engine.generate(f"Story {i}:", greedy)["text"]
    held.set()
    assert re.fullmatch("held[g-i]{3}", slow["code"]) and slow.error() is None


def test_cancel_ends_a_program_whose_pattern_still_compiles(engine, held):
    slow = constrained.run(pattern="held[b-z ]+", stream=True, backend=engine)
    assert held.started.wait(WAIT_S)
    slow.cancel()
    with pytest.raises(lp.ProgramCancelled):
        slow["code"]  # noqa: B018 - at once: the compile is still held
    assert isinstance(slow.error(), lp.ProgramCancelled)
    assert not held.ended.is_set()
    engine.reset_stats()
    held.set()  # its request is sent once the pattern compiles, and aborted at once
    submitted()
    assert engine_leak(engine) is None
    assert engine.stats()["decode_tokens"] <= 1


def test_a_cancel_before_the_round_ends_still_ends_the_program_at_once(engine, held, monkeypatch):
    """The gen was marked compiling only when the interpreter's round sent its requests: a
    cancel between its visit and that moment waited for the compile, and the request sent
    after it was never aborted."""
    import lmprog.outbox as outbox

    in_flush, cancelled = threading.Event(), threading.Event()
    flush = outbox.Outbox.flush

    def paused_flush(self, interp):
        if any(params.get("regex") for *_, params in self.gens):
            in_flush.set()
            cancelled.wait(WAIT_S)  # (the cancel lands here)
        return flush(self, interp)

    monkeypatch.setattr(outbox.Outbox, "flush", paused_flush)
    slow = constrained.run(pattern="held[c-y ]+", stream=True, backend=engine)
    assert in_flush.wait(WAIT_S)
    slow.cancel()
    cancelled.set()
    with pytest.raises(lp.ProgramCancelled):
        slow["code"]  # noqa: B018 - at once: the compile is still held
    assert not held.ended.is_set()
    engine.reset_stats()
    held.set()
    submitted()
    assert engine_leak(engine) is None
    assert engine.stats()["decode_tokens"] <= 1


def test_a_pattern_already_compiled_is_submitted_by_the_interpreter_itself(engine, monkeypatch):
    """A thread per constrained gen (a number gen carries a regex) only where the pattern
    still has to compile."""
    import lmprog.outbox as outbox

    started = []
    thread = threading.Thread

    def counted(*args, **kwargs):
        started.append(kwargs.get("name"))
        return thread(*args, **kwargs)

    @lp.function
    def number(s):
        s += "Age:" + lp.gen("age", dtype=int, max_tokens=4, temperature=0)

    monkeypatch.setattr(outbox.threading, "Thread", counted)
    first = number.run(backend=engine)["age"]
    compiled = started.count("lmprog-submit")
    assert number.run(backend=engine)["age"] == first
    assert started.count("lmprog-submit") == compiled  # (none the second time)


def test_a_healed_gen_goes_to_a_thread_even_where_its_own_pattern_is_compiled(
    engine, held, monkeypatch
):
    """Token healing (text ending in a space) compiles the pattern behind the backed-up
    text, another than the gen's own: the gen's own being compiled says nothing of it."""

    @lp.function
    def healed(s):
        s += "Code: " + lp.gen("code", regex="held[k-m]{2}", max_tokens=8, temperature=0)

    monkeypatch.setattr(engine._grammars, "is_compiled", lambda kind, pattern: True)
    slow = healed.run(stream=True, backend=engine)
    assert held.started.wait(WAIT_S)
    states = plain.run_batch([{"i": i} for i in range(2)], backend=engine)
    assert not held.ended.is_set()  # (they ran while the healed pattern compiled)
    assert all(state.error() is None for state in states)
    held.set()
    assert slow.error() is None and re.fullmatch("held[k-m]{2}", slow["code"])
