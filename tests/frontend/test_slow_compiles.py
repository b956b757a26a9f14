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
