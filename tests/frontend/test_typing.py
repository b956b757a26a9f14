"""A user's program written as the README writes it passes `mypy --strict`, and the types a
checker sees are the ones the calls return: `@lp.function` gave `Any` (so nothing in a
program was checked), `lp.Engine` was `Any` (a lazy attribute), `generate` a union no
checker lets one index, `run_batch` a list-or-iterator, and `forks += ...` a group without
`join()`. Each `assert_type` fails the check when the type is not exactly that."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("mypy")

PROGRAM = """
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from typing_extensions import assert_type

import lmprog as lp
from lmprog_runtime.engine import Engine


@lp.function
def triage(s: lp.ProgramState, question: str) -> str:
    s += lp.user(question)
    s += lp.assistant("Category: " + lp.select("cat", choices=["refund", "other"]))
    forks = s.fork(2)
    forks += lp.user("Draft a reply.")
    forks += lp.assistant(lp.gen("reply", max_tokens=8))
    forks.join()
    return str(s["cat"])


@lp.function()
def other(s: lp.ProgramState, ticket: str) -> None:
    s += lp.user(ticket) + lp.assistant(lp.gen("answer", max_tokens=8))


def use(engine: lp.Engine) -> None:
    assert_type(triage, lp.Function)
    assert_type(other, lp.Function)
    assert_type(lp.Engine, type[Engine])
    state = triage.run(question="My parcel is late", backend=engine)
    assert_type(state, lp.ProgramState)
    print(state.text(), state["cat"])
    states = triage.run_batch([{"question": "a"}], backend=engine)
    assert_type(states, list[lp.ProgramState])
    print(states[0].text(), len(states))
    lazy = triage.run_batch([{"question": "a"}], generator_style=True, backend=engine)
    assert_type(lazy, Iterator[lp.ProgramState])
    one = engine.generate("Once", {"max_new_tokens": 4})
    assert_type(one, dict[str, Any])
    many = engine.generate(["a", "b"], {"max_new_tokens": 4})
    assert_type(many, list[dict[str, Any]])
    ids = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
    assert_type(ids, dict[str, Any])
    chunks = engine.generate("Hi", {"max_new_tokens": 4}, stream=True)
    assert_type(chunks, Iterator[dict[str, Any]])
    print(one["text"], many[0]["text"], ids["text"], [c["text"] for c in chunks])
    # Flags known only at run time: the union, as before (not "no overload matches").
    flag = bool(len(states))
    either = triage.run_batch([{"question": "a"}], generator_style=flag, backend=engine)
    assert_type(either, list[lp.ProgramState] | Iterator[lp.ProgramState])
    prompts: str | list[str] = "x"
    any_kind = engine.generate(prompts, None, stream=flag)
    assert_type(any_kind, dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]])
"""


def test_a_readme_style_program_passes_mypy_strict(tmp_path):
    """(in a process of its own: mypy raises the interpreter's recursion limit and leaves
    it raised, which changed what later tests in the same process saw)"""
    program = tmp_path / "user_program.py"
    program.write_text(PROGRAM, encoding="utf-8")
    command = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent"]
    command += ["--cache-dir", str(tmp_path / "mypy-cache"), str(program)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
