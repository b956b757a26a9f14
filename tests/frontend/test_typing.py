"""A user's program written as the README writes it passes `mypy --strict`, and the types a
checker sees are the ones the calls return: `@lp.function` gave `Any` (so nothing in a
program was checked), `lp.Engine` was `Any` (a lazy attribute), `generate` a union no
checker lets one index, `run_batch` a list-or-iterator, and `forks += ...` a group without
`join()`. Each `assert_type` fails the check when the type is not exactly that. Wrong code
is an error where a checker can tell: a misspelt `lp.` name passed as `Any` (the module's
lazy `__getattr__`), an unknown join mode, `s + x`."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest

pytest.importorskip("mypy")

PROGRAM = """
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

from pydantic import BaseModel
from transformers import PreTrainedTokenizerBase
from typing_extensions import assert_type

import lmprog as lp
from lmprog_runtime.engine import Engine


class Person(BaseModel):
    name: str


def reply(question: str) -> lp.Expr:
    stops = lp.gen("a", stop=("\\n", "."), stop_token_ids=range(2), stop_regex=("x+",))
    return lp.user(question) + lp.assistant(stops)


@lp.function
def shapes(s: lp.ProgramState) -> None:
    s += lp.gen("obj", json_schema={"type": "object"}, dtype=None)
    s += lp.gen("anything", json_schema=True) + lp.gen("person", json_schema=Person)
    s += lp.gen("n", dtype=int) + lp.gen("t", stop_token_ids=7) + reply("q")
    assert_type(s.user(), AbstractContextManager[Any])
    assert_type(s.user("hello"), None)
    with s.assistant():
        s += lp.gen("x", max_tokens=2)
    forks = s.fork(2)
    assert_type(forks[0], lp.ProgramState)
    assert_type([branch for branch in forks], list[lp.ProgramState])
    forks.join("concate_and_append")


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
    assert_type(engine.submit("a"), list[Future[dict[str, Any]]])
    assert_type(engine.get_tokenizer(), PreTrainedTokenizerBase)
    lp.set_default_backend(engine)
    print(lp.flush_cache(engine), shapes.run(backend=engine).text())


async def use_async(engine: lp.Engine) -> None:
    one = await engine.async_generate("Once", {"max_new_tokens": 4})
    assert_type(one, dict[str, Any])
    many = await engine.async_generate(["a", "b"])
    assert_type(many, list[dict[str, Any]])
    ids = await engine.async_generate(input_ids=[1, 2, 3])
    assert_type(ids, dict[str, Any])
    chunks = await engine.async_generate("Hi", stream=True)
    assert_type(chunks, AsyncIterator[dict[str, Any]])
    print(one["text"], many[0]["text"], ids["text"], [c["text"] async for c in chunks])
"""

# Each line marked `# error` must be an error, and nothing else. (`lp.usr` and `lp.Engin`
# were `Any`, `forks.join("concat")` a plain str, `s + "x"` an operand typed as None.)
WRONG_PROGRAM = """
from __future__ import annotations

import lmprog as lp


@lp.function
def wrong(s: lp.ProgramState) -> None:
    s += lp.usr("hi")  # error
    forks = s.fork(2)
    forks.join("concat")  # error
    s + "x"  # error
    s += lp.gen("a", json_schema=3)  # error
    forks[0].nope  # error
    with s.user("text"):  # error
        pass


engine = lp.Engin("tiny")  # error
"""


def _mypy_errors(tmp_path, programs: dict[str, str]) -> dict[str, list[str]]:
    """`mypy --strict`'s errors per program, in a process of its own: mypy raises the
    interpreter's recursion limit and leaves it raised, which changed what later tests in
    the same process saw."""
    paths = []
    for name, text in programs.items():
        paths.append(tmp_path / f"{name}.py")
        paths[-1].write_text(text, encoding="utf-8")
    command = [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent"]
    command += ["--cache-dir", str(tmp_path / "mypy-cache"), *map(str, paths)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert "error: Cannot find" not in proc.stdout, proc.stdout
    errors: dict[str, list[str]] = {name: [] for name in programs}
    for line in proc.stdout.splitlines():
        found = re.match(r"(?:.*[/\\])?(\w+)\.py:(\d+): error:", line)
        if found:
            errors[found[1]].append(found[2] + ": " + line)
    assert proc.returncode in (0, 1) and (proc.returncode == 1) == any(errors.values()), proc
    return errors


def test_a_readme_style_program_passes_mypy_strict_and_wrong_code_fails(tmp_path):
    errors = _mypy_errors(tmp_path, {"user_program": PROGRAM, "wrong_program": WRONG_PROGRAM})
    assert errors["user_program"] == []
    marked = {i + 1 for i, line in enumerate(WRONG_PROGRAM.splitlines()) if "# error" in line}
    lines = {int(error.split(":")[0]) for error in errors["wrong_program"]}
    assert lines == marked, "\n".join(errors["wrong_program"])


# A bare generic (`dict`, `list[Future]`) or a missing annotation in a public signature is
# "partially unknown" to pyright: strict mode then flagged every call (every `lp.gen`).
BARE_GENERIC = re.compile(
    r"\b(dict|list|set|frozenset|tuple|type|Future|Iterator|AsyncIterator|Iterable|"
    r"Callable|Sequence|Mapping|AbstractContextManager)\b(?!\[)"
)
TYPED_DUNDERS = ("__init__", "__call__", "__getitem__", "__iter__", "__iadd__", "__len__")


def _public_functions():
    import lmprog as lp

    for name in lp.__all__:
        obj = getattr(lp, name)
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in inspect.getmembers(obj, inspect.isfunction):
                if not attr.startswith("_") or attr in TYPED_DUNDERS:
                    yield f"{name}.{attr}", member


def test_public_signatures_are_fully_annotated():
    untyped = []
    for label, func in _public_functions():
        signature = inspect.signature(func)
        for param in signature.parameters.values():
            if param.name in ("self", "cls"):
                continue
            annotation = param.annotation
            if annotation is inspect.Parameter.empty or BARE_GENERIC.search(str(annotation)):
                untyped.append(f"{label}({param.name}: {annotation})")
        returns = signature.return_annotation
        if func.__name__ != "__init__" and (
            returns is inspect.Signature.empty or BARE_GENERIC.search(str(returns))
        ):
            untyped.append(f"{label} -> {returns}")
    assert untyped == []
