"""Jump-forward's automaton is built with the grammar, on a compile thread and under the
same timeout: patterns too large or too slow to compile are refused, the engine serves other
requests meanwhile, and a build past the timeout stops and frees its thread."""

from __future__ import annotations

import re
import threading
import time

import pytest

from lmprog_runtime import Engine
from lmprog_runtime.constrained.outlines_backend import OutlinesGrammarBackend


def _block_compiles_of(monkeypatch, regex: str) -> tuple[threading.Event, threading.Event]:
    """Make compiling `regex` block until released. Returns (started, release) events."""
    started, release = threading.Event(), threading.Event()
    compile_regex = OutlinesGrammarBackend.compile_regex

    def blocking(self, pattern):
        if pattern == regex:
            started.set()
            if not release.wait(timeout=120):
                raise RuntimeError("the test never released the compile")
        return compile_regex(self, pattern)

    monkeypatch.setattr(OutlinesGrammarBackend, "compile_regex", blocking)
    return started, release


def test_patterns_too_large_or_too_slow_to_compile_are_refused(tiny_path, monkeypatch):
    """A pattern over the size limit is refused before compiling; one whose compile outlasts
    `grammar_compile_timeout_s` is refused with ValueError, is not remembered, and the engine
    keeps serving. The compile is held until the caller has its answer, so the timeout has
    passed whatever the machine's speed."""
    slow = "(a|b){3}-compiled-slowly"  # cheap to compile once released
    _, release = _block_compiles_of(monkeypatch, slow)
    with Engine(tiny_path, max_total_tokens=1024, grammar_compile_timeout_s=0.05) as engine:
        with pytest.raises(ValueError, match="too large"):
            engine.generate("x", {"regex": "a" * 60_000})
        try:
            with pytest.raises(ValueError, match="longer than"):
                engine.generate("x", {"regex": slow, "max_new_tokens": 4})
        finally:
            release.set()
        assert ("regex", slow) not in engine._grammars._entries
        assert len(engine.generate("still serving", {"max_new_tokens": 3})["output_ids"]) == 3


def test_the_engine_serves_other_requests_while_a_pattern_compiles(engine, monkeypatch):
    """Compiles run on a worker thread: while one is held, an unconstrained request is
    served to the end; released, the constrained request completes and matches."""
    regex = "[xy]{2}-held-compile"
    started, release = _block_compiles_of(monkeypatch, regex)
    result = {}

    def constrained():
        try:
            result.update(engine.generate("Code:", {"regex": regex, "max_new_tokens": 32}))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            result["error"] = error

    worker = threading.Thread(target=constrained)
    worker.start()
    try:
        assert started.wait(timeout=120), "the compile never started"
        free = engine.generate("Once upon a time", {"max_new_tokens": 8, "ignore_eos": True})
        assert len(free["output_ids"]) == 8 and "output_ids" not in result
    finally:
        release.set()
        worker.join()
    assert "error" not in result, result["error"]
    assert re.fullmatch(regex, result["text"]), result


def test_a_slow_jump_forward_fsm_is_bounded_by_the_compile_timeout(tiny_path, monkeypatch):
    """The character FSM is built with the grammar, on the compile thread and within
    `grammar_compile_timeout_s` (its size can explode: `[ab]*a[ab]{14}` once held a
    caller for minutes)."""
    from lmprog_runtime.constrained import jump_forward

    release = threading.Event()
    build = jump_forward.CharFSM.__init__

    def held(self, regex):
        release.wait(timeout=120)
        build(self, regex)

    monkeypatch.setattr(jump_forward.CharFSM, "__init__", held)
    with Engine(tiny_path, max_total_tokens=1024, grammar_compile_timeout_s=0.05) as engine:
        try:
            with pytest.raises(ValueError, match="longer than 0.05 s to compile"):
                engine.generate("x", {"regex": "[ab]{2}-fsm-held", "max_new_tokens": 4})
        finally:
            release.set()


def test_a_compile_past_the_timeout_stops_and_leaves_the_compile_threads_free(
    tiny_path, monkeypatch
):
    """A jump-forward automaton slow to build (interegular's DFA of `(a|b)*a(a|b){13}`
    took minutes; a build that spins stands in for one here). Refused at the timeout, each
    build went on: four of them held every compile thread, and any other pattern then timed
    out behind them. Now each stops at the timeout, and its thread exits."""
    from lmprog_runtime.constrained import jump_forward

    build = jump_forward.CharFSM.__init__

    def slow(self, regex):
        if regex.startswith("(a|b)*"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # (Python code: the timeout interrupts it)
                pass
        build(self, regex)

    monkeypatch.setattr(jump_forward.CharFSM, "__init__", slow)
    before = set(_compile_threads())  # (other engines' compile threads are not this one's)
    with Engine(tiny_path, max_total_tokens=1024, grammar_compile_timeout_s=2) as engine:
        for tail in "cdef":  # one per compile thread
            with pytest.raises(ValueError, match="longer than 2 s"):
                engine.generate("x", {"regex": f"(a|b)*a(a|b){{13}}{tail}", "max_new_tokens": 2})
        out = engine.generate("x", {"regex": "[0-9]{3}", "max_new_tokens": 8})
        assert re.fullmatch("[0-9]{3}", out["text"])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and set(_compile_threads()) - before:
        time.sleep(0.1)
    assert not set(_compile_threads()) - before


def _compile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lmprog-grammar")]
