"""Programs and rows shared by the dataset tests, and loaded by the CLI (`FILE.py:qa`) in
subprocesses, so they must stay importable on their own.

`expected_row` is the reference: `run()` on one row, alone, with the same defaults.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import lmprog as lp

SYSTEMS = [
    f"You are support agent number {g}. " + "Answer briefly and politely. " * 4 for g in range(8)
]
GREEDY = {"temperature": 0}


@lp.function
def qa(s, system, question):
    """A gen, then a select on the answer; returns whether the verdict is yes."""
    s += lp.system(system)
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=5))
    if question.startswith("raise"):
        raise RuntimeError(f"the program raised on {question!r}")
    s += lp.user("Is that right?")
    s += lp.assistant(lp.select("verdict", choices=["yes", "no"]))
    return s["verdict"] == "yes"


@lp.function
def short(s, question):
    """The small program of the kill test: one gen of 3 tokens."""
    s += lp.user(question)
    s += lp.assistant(lp.gen("answer", max_tokens=3))


@lp.function
def ideas(s, topic):
    """A fork: `idea` is gathered as a list of the two branches' values."""
    s += lp.user("Ideas about " + topic)
    forks = s.fork(2)
    for f in forks:
        f += lp.assistant(lp.gen("idea", max_tokens=3))
    forks.join()
    return len(s["idea"])


@lp.function
def explodes(s, question):
    """A regex whose outlines-core compile runs for minutes over the tiny vocabulary."""
    s += lp.user(question)
    s += lp.assistant(lp.gen("code", regex="(abc|def|ghi9){1,20}[a-z0-9]{3,60}x9"))


def make_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` rows over the 8 system prompts, shuffled; ids are ints, questions unique."""
    rng = random.Random(seed)
    rows = [
        {"id": i, "system": SYSTEMS[i % len(SYSTEMS)], "question": f"Where is parcel {i}?"}
        for i in range(n)
    ]
    rng.shuffle(rows)
    return rows


def expected_row(program: lp.Function, row: dict[str, Any], engine, **defaults: Any) -> dict:
    """What `run()` gives for one row: its variables, return value and error."""
    params = program.arg_names
    try:
        state = program.run(**{k: row[k] for k in params}, backend=engine, **GREEDY, **defaults)
    except Exception as error:  # noqa: BLE001 - the reference of an error row
        return {"error": f"{type(error).__name__}: {error}"}
    out = {name: state[name] for name in ("answer", "verdict", "idea") if name in state}
    return {**out, "ret_value": state.ret_value, "error": None}


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
