"""A constrained gen in a program ends where its value fully matches and the model goes on
past the pattern (`end_outside_pattern`, True by default for constrained gens; False is
SGLang's EOS-only rule). The reference is the engine's own `generate` with the same
parameters (tests/runtime/test_end_outside_pattern.py checks that against transformers)."""

from __future__ import annotations

import pytest

import lmprog as lp

PATTERN = "[0-9]{1,3}"


def engine_value(engine, end_outside: bool) -> str:
    params = {"temperature": 0, "max_new_tokens": 6, "regex": PATTERN}
    params |= {"end_outside_pattern": end_outside, "token_healing": True}
    return engine.generate("Age: ", params)["text"]


@pytest.mark.parametrize("option, end_outside", [(None, True), (True, True), (False, False)])
def test_a_constrained_gen_ends_as_asked(engine, option, end_outside):
    @lp.function
    def fill(s):
        s += "Age: " + lp.gen("age", regex=PATTERN, max_tokens=6, end_outside_pattern=option)
        s += "\nName:" + lp.gen("name", max_tokens=4, end_outside_pattern=option)

    state = fill.run(backend=engine, temperature=0)
    assert state.error() is None
    assert state["age"] == engine_value(engine, end_outside)
    assert state.text().startswith("Age: " + state["age"] + "\nName:")


def test_the_run_default_and_the_difference(engine):
    @lp.function
    def fill(s):
        s += "Age: " + lp.gen("age", regex=PATTERN, max_tokens=6)

    ended = fill.run(backend=engine, temperature=0)
    eos_only = fill.run(backend=engine, temperature=0, end_outside_pattern=False)
    assert eos_only["age"] == engine_value(engine, False)
    # (on this model the draw after a full match is almost never a digit)
    assert len(ended["age"]) < len(eos_only["age"])
    assert eos_only["age"].startswith(ended["age"])


def test_bad_end_outside_pattern_is_refused_at_the_gen():
    with pytest.raises(TypeError, match="end_outside_pattern"):
        lp.gen("x", regex="[0-9]+", end_outside_pattern="yes")
