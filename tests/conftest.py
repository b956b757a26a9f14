"""Shared fixtures: one tiny-model engine per session, the clean-engine check, and
compiles held until a test releases them (`held`).

Every `lmprog_runtime.Engine` built while the tests run (by a test, by a fixture of any
scope, or by the library for a test) is registered. After every test, each registered
engine that is still serving must be clean: all KV slots free or held unlocked by the prefix
cache, all request slots and penalty rows free, nothing running or waiting. An engine shut
down during the test (`with Engine(...)`, `engine.shutdown()`) is checked the same way just
before its shutdown, since shutting down fails whatever is left and so hides a leak.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref

# Triton kernels run on CPU tensors only in interpreter mode; it must be chosen before
# Triton compiles (decorates) any kernel.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import settings

# Hypothesis' default 200 ms deadline per example is a timing assertion: none here.
settings.register_profile("lmprog", deadline=None)
settings.load_profile("lmprog")

# How long the check waits for an engine to become clean. It returns as soon as the engine
# is clean (a finished request's slots are released before its caller wakes, so that is at
# once); the bound only limits how long a real leak takes to be reported.
SETTLE_S = 10.0


def engine_leak(engine) -> dict[str, int] | None:
    """None if `engine` is clean (waiting up to SETTLE_S for it to become so), else the
    state of its memory that shows the leak (see `Engine.memory_state`)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        state = engine.memory_state()
        clean = (
            state["kv_slots_free"] + state["kv_slots_cached"] == state["kv_slots_total"]
            and state["kv_slots_locked"] == 0
            and state["req_slots_free"] == state["req_slots_total"]
            and state["num_running"] == 0
            and state["num_waiting"] == 0
            and state["penalty_rows_used"] == 0
        )
        if clean:
            return None
        if time.monotonic() > deadline:
            return state
        time.sleep(0.01)  # polling a condition; passing never depends on this delay


class EngineRegistry:
    """Every Engine built in this session (weakly held) and what their shutdowns found.

    An engine found leaking is reported once, by the test where the leak showed, and not
    checked again (every later test would fail for the same reason)."""

    def __init__(self) -> None:
        self.engines: weakref.WeakSet = weakref.WeakSet()
        self.reported: weakref.WeakSet = weakref.WeakSet()
        self.leaks_at_shutdown: list[str] = []

    def _leak(self, engine) -> str | None:
        if engine in self.reported or engine._stopping:
            return None
        # A loop thread that died without a shutdown strands every request: report it.
        state = engine_leak(engine) if engine._thread.is_alive() else "its loop thread died"
        if state is None:
            return None
        self.reported.add(engine)
        return f"engine 0x{id(engine):x} ({engine.config.model_path}): {state}"

    def on_shutdown(self, engine) -> None:
        leak = self._leak(engine)
        if leak is not None:
            self.leaks_at_shutdown.append(leak)

    def leaks(self) -> list[str]:
        """Leaks found at shutdowns since the last call, then in every serving engine."""
        found, self.leaks_at_shutdown = self.leaks_at_shutdown, []
        found += [leak for e in list(self.engines) if (leak := self._leak(e)) is not None]
        return found


@pytest.fixture(scope="session", autouse=True)
def _engine_registry():
    from lmprog_runtime import Engine

    registry = EngineRegistry()
    init, shutdown = Engine.__init__, Engine.shutdown

    @functools.wraps(init)  # (its signature, for tests that read the public ones)
    def registering_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        registry.engines.add(self)

    @functools.wraps(shutdown)
    def checking_shutdown(self):
        if threading.current_thread() is not self._thread:  # (from a callback, it is refused)
            registry.on_shutdown(self)
        shutdown(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "__init__", registering_init)
        patch.setattr(Engine, "shutdown", checking_shutdown)
        yield registry
        leaks = registry.leaks()  # engines shut down by module- or session-scoped fixtures
    assert not leaks, f"engines not clean at the end of the session: {leaks}"


@pytest.fixture(autouse=True)
def _engines_clean_after_test(_engine_registry):
    yield
    leaks = _engine_registry.leaks()
    assert not leaks, f"engines not clean after this test: {leaks}"


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from lmprog_runtime import default_model_path

    return default_model_path("tiny")


@pytest.fixture(scope="session")
def _session_engine(tiny_path):
    from lmprog_runtime import Engine

    engine = Engine(tiny_path, max_total_tokens=16384, max_running_requests=32)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(_session_engine):
    """The session's tiny-model engine (checked clean after the test like every engine)."""
    return _session_engine


@pytest.fixture(scope="session")
def hf_tiny(tiny_path):
    """transformers' own model and tokenizer for the same tiny checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_path)


# How long a held compile waits for its test's release at most.
HELD_WAIT_S = 60


@pytest.fixture
def held(engine, monkeypatch):
    """Patterns holding `held` compile only once the returned event is set (or after
    HELD_WAIT_S); its `started` and `ended` say where such a compile stands."""
    engine.grammar("regex", "[ab]")  # (the engine's grammar cache exists from here)
    backend = engine._grammars.backend
    release, started, ended = threading.Event(), threading.Event(), threading.Event()
    compile_regex = backend.compile_regex

    def held_compile(regex):
        if "held" in regex:  # (a healed pattern begins with the backed-up text)
            started.set()
            release.wait(HELD_WAIT_S)
            ended.set()
        return compile_regex(regex)

    monkeypatch.setattr(backend, "compile_regex", held_compile)
    release.started, release.ended = started, ended
    yield release
    release.set()
