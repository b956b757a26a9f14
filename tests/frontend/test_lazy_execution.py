"""Lazy execution (issue 12): the body runs once, values are real, errors stay with their
program, and nothing outlives a batch.

The property test draws random programs as data (appends, greedy gens with stop strings,
selects, forks joined both ways with gens and Python branches in the branches, Python
branches on generated values, tool calls) and interprets the same data twice: as an
`@lp.function` run by lmprog (`run` and `run_batch`), and by the plain reference interpreter
of `reference_interpreter.py`, which sends one `Engine.generate` request at a time. Both
must give the same text, variables, return value and tool-call count, and lmprog must run
each body exactly once.

The same engine serves both sides, so a difference is lmprog's: greedy output does not
depend on batching or the prefix cache (a runtime correctness anchor). A select whose two
best choices score within 1e-4 of each other is skipped (batching noise could flip it).
A program that deadlocks fails with `Hung` after HANG_S instead of hanging the suite.

Then: `run_batch` of 2,000 tiny programs leaves no thread behind (peak traced memory is
printed), a prompt longer than the context fails only its own program, exceptions of a
body reach `run()` unchanged and `error()` in a batch, and bodies compute with real values.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import signal
import threading
import time
import tracemalloc
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from reference_interpreter import (  # the module beside this file
    ReferenceInterpreter,
    flatten_value,
    name_program,
    tool_text,
)

import lmprog as lp
import lmprog.backend

HYPO = settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture])
MANY = settings(HYPO, max_examples=1500)  # the slow tier

# ---- counting bodies and tools (programs of a batch run on several threads) ----------------
_lock = threading.Lock()
BODY_RUNS: Counter = Counter()
TOOL_CALLS: Counter = Counter()
_keys = itertools.count()


def new_key() -> int:
    return next(_keys)


def count(counter: Counter, key: object) -> None:
    with _lock:
        counter[key] += 1


def tool(key: object, value: str) -> str:
    """A tool the program calls with a generated value; its result is appended."""
    assert isinstance(value, str), f"the tool got {type(value).__name__}, not the real value"
    count(TOOL_CALLS, key)
    return tool_text(value)


# ---- the random program, run by lmprog -----------------------------------------------------
def source_value(s, order: list[str]) -> str:
    """The latest variable of this level (a gathered list joined), else the text."""
    if order:
        return flatten_value(s[order[-1]])
    return s.text()


def run_ops(s, ops: list, key: object, order: list[str]) -> None:
    for op in ops:
        kind = op[0]
        if kind == "text":
            s += op[1]
        elif kind == "gen":
            _, name, max_tokens, stop = op
            s += lp.gen(name, max_tokens=max_tokens, stop=stop, temperature=0)
            order.append(name)
        elif kind == "select":
            _, name, choices = op
            s += lp.select(name, choices=list(choices))
            order.append(name)
        elif kind == "tool":
            s += tool(key, source_value(s, order))
        elif kind == "if":
            if len(source_value(s, order)) % 2:
                run_ops(s, op[1], key, order)
            else:
                run_ops(s, op[2], key, order)
        elif kind == "fork":
            run_fork(s, op, order)
        else:
            raise AssertionError(f"unknown op {op!r}")


def _append_to_branches(forks, n: int, style: str, item_of) -> None:
    """Append item_of(i) to branch i, in one of the ways a program can write it."""
    if style == "all":
        forks += item_of
    elif style == "list":
        forks += [item_of(i) for i in range(n)]
    elif style == "setitem":
        for i in range(n):
            forks[i] += item_of(i)
    else:  # "iter"
        for i, f in enumerate(forks):
            f += item_of(i)


def run_fork(s, op: tuple, order: list[str]) -> None:
    _, n, branch_ops, mode, style = op
    forks = s.fork(n)
    made: list[str] = []
    for bop in branch_ops:
        kind = bop[0]
        if kind == "text":
            text = bop[1]
            if style == "all":
                forks += text
            else:
                _append_to_branches(forks, n, style, lambda i, t=text: t)
        elif kind == "btext":
            _append_to_branches(forks, n, style, lambda i: f" b{i}")
        elif kind == "pread":  # the parent is read while its fork is open
            mark = f" p{len(source_value(s, order)) % 7}"
            _append_to_branches(forks, n, style, lambda i, mark=mark: mark)
        elif kind == "bif":
            for i in range(n):
                branch = forks[i]
                value = branch[made[-1]] if made else branch.text()
                if len(value) % 2:
                    forks[i] += " odd"
        elif kind == "gen":
            _, name, max_tokens, stop = bop
            expr = lp.gen(name, max_tokens=max_tokens, stop=stop, temperature=0)
            if style == "all":
                forks += expr  # one expression for every branch
            else:
                _append_to_branches(
                    forks,
                    n,
                    style,
                    lambda i, name=name, m=max_tokens, stop=stop: lp.gen(
                        name, max_tokens=m, stop=stop, temperature=0
                    ),
                )
            made.append(name)
        elif kind == "select":
            _, name, choices = bop
            _append_to_branches(
                forks, n, style, lambda i, name=name, c=choices: lp.select(name, choices=list(c))
            )
            made.append(name)
        else:
            raise AssertionError(f"unknown branch op {bop!r}")
    forks.join(mode)
    if mode == "gather_variable":
        order.extend(made)


@lp.function
def random_program(s, ops, key):
    count(BODY_RUNS, key)
    order: list[str] = []
    run_ops(s, ops, key, order)
    return source_value(s, order) + "!"


# ---- the strategy --------------------------------------------------------------------------
WORDS = ["Q:", " The", " cat", " sat", " on", " mat", ".", "\n", " 1", "2", " é", " yes", "A:",
         " hello", " th"]  # fmt: skip
CHOICES = [" yes", " no", " maybe", " red", " blue", "42", " the cat", "ing", "\n"]
STOPS = [None, [" "], ["e"], ["\n"], [".", ","], ["a", "o"], ["th"]]

texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(lambda w: ("text", "".join(w)))
gens = st.tuples(st.just("gen"), st.integers(1, 5), st.sampled_from(STOPS))
selects = st.tuples(
    st.just("select"),
    st.lists(st.sampled_from(CHOICES), min_size=2, max_size=3, unique=True).map(tuple),
)
tools = st.just(("tool",))
leaves = st.one_of(texts, gens, selects, tools)
branch_ops = st.one_of(
    texts, st.just(("btext",)), st.just(("bif",)), st.just(("pread",)), gens, selects
)
forks = st.tuples(
    st.just("fork"),
    st.integers(1, 3),
    st.lists(branch_ops, min_size=1, max_size=4),
    st.sampled_from(["gather_variable", "concate_and_append"]),
    st.sampled_from(["all", "list", "setitem", "iter"]),
)
blocks = st.lists(st.one_of(leaves, forks), max_size=3)
ifs = st.tuples(st.just("if"), blocks, blocks)
programs = st.tuples(
    texts, st.lists(st.one_of(leaves, leaves, forks, ifs), min_size=1, max_size=6)
).map(lambda p: name_program([p[0], *p[1]]))


# ---- checks --------------------------------------------------------------------------------
def assert_matches(state, expected, key, program) -> None:
    where = f"program {program!r}"
    assert state.error() is None, f"{where} failed: {state.error()!r}"
    assert state.text() == expected.text, where
    for name, value in expected.variables.items():
        assert state[name] == value, f"{where}: variable {name!r}"
        assert type(state[name]) is type(value), f"{where}: variable {name!r}"
    assert state.ret_value == expected.ret, where
    assert BODY_RUNS[key] == 1, f"{where}: body ran {BODY_RUNS[key]} times"
    assert TOOL_CALLS[key] == expected.tool_calls, f"{where}: tool calls"


# A program that deadlocks must fail its test, not hang it: hypothesis would catch
# pytest-timeout's failure and replay (shrink) the example, hanging again each time.
HANG_S = 60.0


class Hung(BaseException):
    """Not an `Exception`, so hypothesis reports it at once instead of shrinking."""


def with_watchdog(what: str, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a helper thread; raises `Hung` if it has not returned after
    HANG_S (a bound for deadlocks only: a correct run takes well under a second)."""
    done, box = threading.Event(), {}

    def call():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=call, name="lazy-test-caller", daemon=True).start()
    if not done.wait(HANG_S):
        raise Hung(f"{what} has not returned after {HANG_S:.0f} s: deadlocked")
    if "error" in box:
        raise box["error"]
    return box["value"]


def check_programs(engine, progs: list[list], *, drawn: bool = True) -> None:
    ref = ReferenceInterpreter(engine)
    expected = [ref.run(p) for p in progs]
    if drawn:
        if any(e.near_tie for e in expected):
            event("a select's two best choices tie: skipped")
        assume(not any(e.near_tie for e in expected))
    else:
        assert not any(e.near_tie for e in expected), "choose choices that do not tie"

    key = new_key()
    state = with_watchdog(
        f"run of {progs[0]!r}", random_program.run, ops=progs[0], key=key, backend=engine
    )
    assert_matches(state, expected[0], key, progs[0])

    keys = [new_key() for _ in progs]
    states = with_watchdog(
        f"run_batch of {progs!r}",
        random_program.run_batch,
        [{"ops": p, "key": k} for p, k in zip(progs, keys)],
        backend=engine,
    )
    assert len(states) == len(progs)
    for state, exp, k, p in zip(states, expected, keys, progs):
        assert_matches(state, exp, k, p)


@HYPO
@given(progs=st.lists(programs, min_size=1, max_size=3))
def test_random_programs_equal_the_reference_interpreter(engine, progs):
    check_programs(engine, progs)


@pytest.mark.slow
@MANY
@given(progs=st.lists(programs, min_size=1, max_size=5))
def test_random_programs_equal_the_reference_interpreter_many(engine, progs):
    check_programs(engine, progs)


def test_a_fixed_program_of_every_kind_equals_the_reference(engine):
    """One hand-written program with every op (the property test's examples vary)."""
    prog = name_program(
        [
            ("text", "Q: The cat"),
            ("gen", 4, [" "]),
            ("select", (" yes", " no", " maybe")),
            ("tool",),
            ("if", [("gen", 2, None), ("tool",)], [("text", " even"), ("select", (" red", "42"))]),
            (
                "fork",
                3,
                [("btext",), ("gen", 3, ["e"]), ("bif",), ("select", (" a", " b"))],
                "gather_variable",
                "setitem",
            ),
            ("tool",),
            (
                "fork",
                2,
                [("text", " go"), ("btext",), ("gen", 2, None)],
                "concate_and_append",
                "iter",
            ),
            ("gen", 3, None),
        ]
    )
    check_programs(engine, [prog, prog], drawn=False)


def test_a_branch_is_readable_before_anything_is_appended_to_it(engine):
    """`forks[i].text()` right after `s.fork(n)` is the parent's text (the property test's
    `bif` as a fork's first op reads it so)."""

    @lp.function
    def prog(s):
        s += "Q: The cat" + lp.gen("a", max_tokens=3, temperature=0)
        forks = s.fork(2)
        before = [forks[i].text() for i in range(2)]
        forks += lp.gen("x", max_tokens=2, temperature=0)
        forks.join()
        return before

    ref = ReferenceInterpreter(engine)
    a = ref.gen("Q: The cat", 3, None)
    x = ref.gen("Q: The cat" + a, 2, None)
    state = with_watchdog("a read of a branch with nothing appended", prog.run, backend=engine)
    assert state.ret_value == ["Q: The cat" + a] * 2
    assert state["x"] == [x, x]


# ---- many programs -------------------------------------------------------------------------
@lp.function
def tiny_program(s, prompt, n):
    s += prompt + lp.gen("x", max_tokens=n, temperature=0)


def wait_for_threads(baseline: set[int], timeout_s: float = 10.0) -> list[threading.Thread]:
    """Threads not in `baseline` still alive after up to `timeout_s` (polled: the interpreter
    thread exits on its own once idle, and nothing signals that)."""
    deadline = time.monotonic() + timeout_s
    while True:
        extra = [t for t in threading.enumerate() if t.ident not in baseline]
        if not extra or time.monotonic() >= deadline:
            return extra
        time.sleep(0.05)


def _tiny_batch(n: int) -> list[dict]:
    return [{"prompt": f"Item {i}:", "n": 1 + i % 2} for i in range(n)]


def _expected_tiny(engine, batch: list[dict]) -> list[str]:
    """Greedy outputs, all prompts as one engine batch (greedy is batch-independent)."""
    ref = ReferenceInterpreter(engine)
    outs = engine.generate(
        input_ids=[ref.encode(b["prompt"]) for b in batch],
        sampling_params=[{"max_new_tokens": b["n"], "temperature": 0} for b in batch],
    )
    return [o["text"] for o in outs]


def test_run_batch_of_2000_leaves_no_thread_and_reports_memory(engine):
    batch = _tiny_batch(2000)
    expected = _expected_tiny(engine, batch)
    gc.collect()
    baseline_count = threading.active_count()
    baseline = {t.ident for t in threading.enumerate()}
    tracemalloc.start()
    try:
        states = tiny_program.run_batch(batch, backend=engine)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"\nrun_batch of 2000 tiny programs: peak traced memory {peak / 2**20:.1f} MiB")
    assert len(states) == 2000
    failed = [(i, s.error()) for i, s in enumerate(states) if s.error() is not None]
    assert not failed, failed[:5]
    assert [s["x"] for s in states] == expected
    assert [s.text() for s in states] == [b["prompt"] + e for b, e in zip(batch, expected)]
    extra = wait_for_threads(baseline)
    assert not extra, f"{len(extra)} threads left: {sorted({t.name for t in extra})}"
    assert threading.active_count() <= baseline_count
    # Generous: 2,000 states of a few dozen characters each are far below this.
    assert peak < 512 * 2**20, f"peak traced memory {peak / 2**20:.1f} MiB"


def test_a_too_long_prompt_fails_only_its_program(engine):
    long_prompt = " word" * (engine.context_len + 50)
    assert len(engine.encode(long_prompt)) > engine.context_len
    batch = _tiny_batch(2000)
    bad = 1234
    batch[bad] = {"prompt": long_prompt, "n": 1}
    good = [b for i, b in enumerate(batch) if i != bad]
    expected = iter(_expected_tiny(engine, good))
    baseline = {t.ident for t in threading.enumerate()}
    states = tiny_program.run_batch(batch, backend=engine)
    assert len(states) == 2000
    error = states[bad].error()
    assert isinstance(error, ValueError), repr(error)
    assert str(engine.context_len) in str(error), str(error)
    for i, state in enumerate(states):
        if i != bad:
            assert state.error() is None, (i, state.error())
            assert state["x"] == next(expected), i
    extra = wait_for_threads(baseline)
    assert not extra, f"{len(extra)} threads left: {sorted({t.name for t in extra})}"


def test_run_raises_the_too_long_prompt_error_unchanged(engine):
    long_prompt = " word" * (engine.context_len + 50)
    with pytest.raises(ValueError, match=str(engine.context_len)):
        tiny_program.run(prompt=long_prompt, n=1, backend=engine)


# ---- errors and real values ----------------------------------------------------------------
class Boom(Exception):
    pass


RAISED: dict[object, BaseException] = {}


@lp.function
def raising(s, key, where):
    count(BODY_RUNS, key)
    if where == "before":
        error = Boom(f"before {key}")
        RAISED[key] = error
        raise error
    s += "Hello there:" + lp.gen("a", max_tokens=4, temperature=0)
    if where == "after_read":
        assert isinstance(s["a"], str)
    if where in ("in_flight", "after_read"):
        error = Boom(f"{where} {key}")
        RAISED[key] = error
        raise error
    s += " then" + lp.gen("b", max_tokens=2, temperature=0)


@pytest.mark.parametrize("where", ["before", "in_flight", "after_read"])
def test_run_raises_the_body_exception_unchanged(engine, where):
    key = new_key()
    with pytest.raises(Boom) as info:
        raising.run(key=key, where=where, backend=engine)
    assert info.value is RAISED[key]
    assert BODY_RUNS[key] == 1


def test_run_batch_keeps_each_body_exception_in_its_state(engine):
    wheres = ["none", "before", "none", "in_flight", "after_read", "none"] * 3
    keys = [new_key() for _ in wheres]
    states = raising.run_batch(
        [{"key": k, "where": w} for k, w in zip(keys, wheres)], backend=engine
    )
    ref = ReferenceInterpreter(engine)
    a = ref.gen("Hello there:", 4, None)
    b = ref.gen("Hello there:" + a + " then", 2, None)
    for state, key, where in zip(states, keys, wheres):
        assert BODY_RUNS[key] == 1
        if where == "none":
            assert state.error() is None
            assert (state["a"], state["b"]) == (a, b)
            assert state.text() == "Hello there:" + a + " then" + b
        else:
            assert state.error() is RAISED[key], (where, state.error())


@lp.function
def sets_then_raises(s, key, where):
    s += "Intro:"
    s["mine"] = key
    s += " more"
    if where == "after_read":
        s += lp.gen("a", max_tokens=3, temperature=0)
        s["copy"] = s["a"]
        s += "!"
    elif where == "in_flight":
        s += lp.gen("a", max_tokens=64, temperature=0, ignore_eos=True)
        s["after"] = 1
    error = Boom(f"{where} {key}")
    RAISED[key] = error
    raise error


def test_what_a_body_set_before_it_raised_stays_in_its_state(engine):
    """The nodes a body appended before its raise that need no request still run (the
    variables and text were lost: a dataset row had none of them); a request in flight is
    aborted, the program failing with the body's exception, not the abort's."""
    wheres = ["before", "after_read", "in_flight"] * 2
    keys = [new_key() for _ in wheres]
    states = sets_then_raises.run_batch(
        [{"key": k, "where": w} for k, w in zip(keys, wheres)], backend=engine
    )
    a = ReferenceInterpreter(engine).gen("Intro: more", 3, None)
    for state, key, where in zip(states, keys, wheres):
        assert state.error() is RAISED[key], (where, state.error())
        names = {name for name in ("mine", "a", "copy", "after") if name in state}
        assert "mine" in names and state["mine"] == key, (where, names)
        if where == "before":
            assert (names, state.text()) == ({"mine"}, "Intro: more")
        elif where == "after_read":
            assert names == {"mine", "a", "copy"} and state["a"] == state["copy"] == a
            assert state.text() == "Intro: more" + a + "!"
        else:  # (the gen of 64 tokens is aborted; nothing after it runs)
            assert "after" not in names
    for _ in range(20):  # (a body raising once all it appended had run: a sync saw no error)
        key = new_key()
        state = raising.run(key=key, where="after_read", backend=engine, stream=True)
        state.sync()
        assert state.error() is RAISED[key]


def test_a_raise_while_the_join_is_visited_fails_the_program_there(engine, monkeypatch):
    """A raise landing while the interpreter looked at a join (here it waits there for the
    raise) waited for the branches to finish, their requests never aborted; now the
    program fails at the join and the branches' requests are aborted."""
    from lmprog.interpreter import Interpreter
    from lmprog.ir import Join

    visit, at_join = Interpreter._visit, threading.Event()

    def held(self, stream, node, outbox):
        if isinstance(node, Join) and not at_join.is_set():
            at_join.set()
            deadline = time.monotonic() + 30
            while stream.raised is None and time.monotonic() < deadline:
                time.sleep(0.001)
        return visit(self, stream, node, outbox)

    monkeypatch.setattr(Interpreter, "_visit", held)

    @lp.function
    def forks_then_raises(s, key):
        s += "Hello"
        forks = s.fork(2)
        forks += lp.gen("b", max_tokens=2000, ignore_eos=True)
        forks.join()
        error = Boom(f"after the join {key}")
        RAISED[key] = error
        at_join.wait(30)
        raise error

    key = new_key()
    engine.reset_stats()
    state = forks_then_raises.run_batch([{"key": key}], backend=engine)[0]
    assert state.error() is RAISED[key]
    # The branches' 2,000 tokens each were aborted. (The group's internal prefill of their
    # shared text may finish first: whether it does is a matter of timing.)
    stats = engine.stats()
    assert stats["finished_requests"] <= 1 and stats["decode_tokens"] < 2000


def test_return_of_a_generated_value_is_a_str(engine):
    @lp.function
    def shout(s):
        s += "Say:" + lp.gen("a", max_tokens=3, temperature=0)
        return s["a"] + "!"

    a = ReferenceInterpreter(engine).gen("Say:", 3, None)
    state = shout.run(backend=engine)
    assert type(state.ret_value) is str
    assert state.ret_value == a + "!"
    states = shout.run_batch([{}, {}], backend=engine)
    assert [s.ret_value for s in states] == [a + "!", a + "!"]


NUMBER = r"[1-9][0-9]{0,2}"


@lp.function
def real_values(s, key):
    count(BODY_RUNS, key)
    s += "Number: " + lp.gen("n", regex=NUMBER, max_tokens=6, temperature=0)
    s += "\nWord:" + lp.gen("w", max_tokens=4, stop=["\n"], temperature=0)
    n = json.loads(s["n"])
    w = s["w"].strip()
    s += " big" if n > 500 else " small"
    s += " same" if w == s["w"] else " stripped"
    s += " late" if s["w"] > "m" else " early"
    s += " e" if "e" in s["w"] else " no-e"
    s += tool(key, s["w"])
    s += " more:" + lp.gen("m", max_tokens=3, temperature=0)
    if len(s["m"]) % 2:
        s += " odd" + lp.gen("o", max_tokens=2, temperature=0)
    _ = (s["n"], s["w"], s["m"], s.text())  # later reads run nothing again
    return {"n": n, "w": w, "m": s["m"]}


def reference_real_values(engine) -> tuple[str, dict]:
    ref = ReferenceInterpreter(engine)
    text = "Number: "
    n_text = ref.gen(text, 6, None, regex=NUMBER)
    text += n_text + "\nWord:"
    w_text = ref.gen(text, 4, ["\n"])
    text += w_text
    n, w = json.loads(n_text), w_text.strip()
    text += " big" if n > 500 else " small"
    text += " same" if w == w_text else " stripped"
    text += " late" if w_text > "m" else " early"
    text += " e" if "e" in w_text else " no-e"
    text += tool_text(w_text) + " more:"
    m = ref.gen(text, 3, None)
    text += m
    if len(m) % 2:
        text += " odd"
        text += ref.gen(text, 2, None)
    return text, {"n": n, "w": w, "m": m}


def test_body_uses_real_values_and_runs_once_with_its_tool(engine):
    text, ret = reference_real_values(engine)
    key = new_key()
    state = real_values.run(key=key, backend=engine)
    assert state.error() is None
    assert state.text() == text
    assert state.ret_value == ret
    assert (BODY_RUNS[key], TOOL_CALLS[key]) == (1, 1)

    keys = [new_key() for _ in range(6)]
    states = real_values.run_batch([{"key": k} for k in keys], backend=engine)
    for state, key in zip(states, keys):
        assert state.error() is None
        assert (state.text(), state.ret_value) == (text, ret)
        assert (BODY_RUNS[key], TOOL_CALLS[key]) == (1, 1)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_a_program_runs_runs_its_own(engine):
    """The child inherited the interpreter's thread as running (only the forking thread
    goes with a fork), so its first program waited forever."""
    from concurrent.futures import Future

    class Later(lmprog.backend.EngineBackend):  # answers each request once `release` is set
        release = threading.Event()

        def submit(self, input_ids, params, **options):
            futures = [Future() for _ in input_ids]

            def answer():
                self.release.wait(30)
                for future, out in zip(futures, super(Later, self).submit(input_ids, params)):
                    future.set_result(out.result())

            threading.Thread(target=answer, daemon=True).start()
            return futures

    @lp.function
    def hello(s):
        s += "Hello," + lp.gen("a", max_tokens=2, temperature=0)

    running = hello.run(backend=Later(engine), stream=True)
    pid = os.fork()
    if pid == 0:  # the child: a program on a backend without threads or torch
        code = 1
        try:
            code = 0 if _echo_program_runs() else 1
        finally:
            os._exit(code)
    Later.release.set()
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    assert running["a"] is not None


def _echo_program_runs() -> bool:
    from concurrent.futures import Future

    class Echo(lp.Backend):
        def encode(self, text):
            return [1 + ord(c) % 100 for c in text]

        def decode(self, ids):
            return "x" * len(ids)

        def submit(self, input_ids, params, **options):
            future = Future()
            meta = {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}
            meta["finish_reason"] = {"type": "length", "length": 1}
            future.set_result({"text": "ok", "output_ids": [1], "meta_info": meta})
            return [future]

        def render_chat(self, messages, add_generation_prompt=False):
            raise ValueError("no chat template")

        @property
        def context_token_id(self):
            return 0

    @lp.function
    def echo(s):
        s += "hi" + lp.gen("a", max_tokens=1)

    return echo.run(backend=Echo())["a"] == "ok"
