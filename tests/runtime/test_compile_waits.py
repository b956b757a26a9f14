"""Waiting for a pattern's compile, and other waits that never end, from the engine's side.

- `async_generate` of a `regex` / `json_schema` request compiled its pattern on the event
  loop's thread: the loop stopped for the compile (seconds, up to its timeout).
- A stream's request whose event loop was closed ran to its end, logging an error per token.
- `async_generate(stream=True)` checked its input, and sent its request, only once read.
- A compile queued behind slow ones was charged for their time, and a trivial pattern
  failed as "too slow".
- An interruption (a compile's timeout) landing inside `subprocess.Popen` left the child
  process unreaped (a zombie per timeout, kept after shutdown).
- In a child forked from the engine's process, the engine has no loop thread: `submit`,
  `async_generate` and programs queued requests no one would run, and waited forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import engine_leak

from lmprog_runtime import Engine
from lmprog_runtime.constrained import GrammarCache, index_process
from lmprog_runtime.constrained.outlines_backend import OutlinesGrammarBackend

WAIT_S = 60


def test_the_event_loop_runs_while_a_pattern_compiles(engine, held):
    plain = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def main():
        slow = asyncio.create_task(
            engine.async_generate("Code:", {"regex": "held[a-c]{3}", "max_new_tokens": 8})
        )
        await asyncio.to_thread(held.started.wait, WAIT_S)
        other = await engine.async_generate("Once upon", plain)  # (the loop is free)
        assert not held.ended.is_set()
        held.set()
        return other, await slow

    other, slow = asyncio.run(main())
    assert other["output_ids"] == engine.generate("Once upon", plain)["output_ids"]
    assert re.fullmatch("held[a-c]{3}", slow["text"])


def test_a_task_cancelled_while_its_pattern_compiles_aborts_its_request(engine, held):
    async def main():
        slow = asyncio.create_task(
            engine.async_generate(
                "Code:",
                {"regex": "held[a-z ]+", "max_new_tokens": 300, "temperature": 0},
                stream=True,
            )
        )
        await asyncio.to_thread(held.started.wait, WAIT_S)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert not held.ended.is_set()

    asyncio.run(main())
    engine.reset_stats()
    held.set()  # the request is sent once its pattern compiles, and aborted at once
    for thread in threading.enumerate():
        if thread.name == "lmprog-async-submit":
            thread.join(WAIT_S)
    assert engine_leak(engine) is None
    assert engine.stats()["decode_tokens"] <= 1


def test_a_stream_checks_its_input_and_starts_at_the_await(engine):
    greedy = {"max_new_tokens": 4, "temperature": 0}

    async def main():
        with pytest.raises(ValueError, match="max_new_tokens"):
            await engine.async_generate("x", {"max_new_tokens": -5}, stream=True)
        engine.reset_stats()
        chunks = await engine.async_generate("x", greedy, stream=True)
        assert await asyncio.to_thread(engine_leak, engine) is None  # it ran, unread
        assert engine.stats()["finished_requests"] == 1
        return "".join([chunk["text"] async for chunk in chunks])

    assert asyncio.run(main()) == engine.generate("x", greedy)["text"]


def test_a_stream_dropped_before_its_first_read_is_aborted(engine):
    async def main():
        chunks = await engine.async_generate(
            "x", {"max_new_tokens": 3000, "ignore_eos": True}, stream=True
        )
        del chunks  # (the caller changed its mind: never read)
        await asyncio.to_thread(lambda: engine_leak(engine))

    engine.reset_stats()
    asyncio.run(main())
    assert engine_leak(engine) is None
    assert engine.stats()["decode_tokens"] < 100  # (3000 asked)


def test_a_compile_queued_behind_stuck_ones_gives_up_after_a_few_timeouts(tokenizer):
    """Behind compiles that never come back (native code in their threads), a queued one
    is refused after `QUEUED_TIMEOUTS` of its timeout, saying why."""
    from lmprog_runtime.constrained.grammar_cache import QUEUED_TIMEOUTS

    release = threading.Event()
    backend = _Stall(tokenizer, tokenizer.eos_token_id, release)
    cache = GrammarCache(backend, timeout_s=1.0)
    try:
        stalls = stall_every_thread(cache, backend)
        with pytest.raises(ValueError, match="no compile thread was free"):
            cache.get("regex", "[ab]")
        assert not release.is_set() and QUEUED_TIMEOUTS > 1
    finally:
        release.set()
        for thread in stalls:
            thread.join(WAIT_S)
        cache.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (its task)
def test_a_stream_whose_event_loop_closed_is_aborted(engine, caplog):
    loop = asyncio.new_event_loop()
    started = threading.Event()

    async def read():
        params = {"max_new_tokens": 3000, "ignore_eos": True}
        chunks = await engine.async_generate("x", params, stream=True)
        async for _ in chunks:
            started.set()

    task = loop.create_task(read())
    while not started.is_set():
        loop.run_until_complete(asyncio.sleep(0.01))
    engine.reset_stats()
    loop.close()  # (its task not cancelled: the stream's reader is gone)
    assert engine_leak(engine) is None
    assert engine.stats()["decode_tokens"] < 100  # (3000 asked)
    assert len([r for r in caplog.records if "on_chunk" in r.getMessage()]) <= 1
    with contextlib.suppress(RuntimeError):  # (its loop is closed)
        task.get_coro().close()  # (here, not in a later test: its warning is ignored here)
    del task, loop
    gc.collect()


class _Stall(OutlinesGrammarBackend):
    """Patterns beginning with `stall` wait (in native-like code: no interruption lands)
    until `release` is set."""

    def __init__(self, tokenizer, eos_token_id, release):
        super().__init__(tokenizer, eos_token_id)
        self.release = release
        self.entered = threading.Semaphore(0)  # one per stall begun

    def compile_regex(self, regex):
        if regex.startswith("stall"):
            self.entered.release()
            self.release.wait(WAIT_S)
        return super().compile_regex(regex)


def stall_every_thread(cache: GrammarCache, backend: _Stall) -> list[threading.Thread]:
    """Four stalled compiles: every thread of the cache's pool busy."""
    stalls = [threading.Thread(target=lambda i=i: _refused(cache, f"stall{i}")) for i in range(4)]
    for thread in stalls:
        thread.start()
    for _ in stalls:
        assert backend.entered.acquire(timeout=WAIT_S)
    return stalls


def _refused(cache: GrammarCache, pattern: str) -> None:
    with pytest.raises(ValueError):
        cache.get("regex", pattern)


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def test_a_compile_queued_behind_slow_ones_is_not_charged_for_their_time(tokenizer):
    release = threading.Event()
    backend = _Stall(tokenizer, tokenizer.eos_token_id, release)
    cache = GrammarCache(backend, timeout_s=2.0)
    try:
        stalls = stall_every_thread(cache, backend)
        threading.Timer(3.0, release.set).start()  # (past their timeout: they are abandoned)
        grammar = cache.get("regex", "[ab]")  # queued behind them until they end
        assert release.is_set() and grammar.new_matcher() is not None
        for thread in stalls:
            thread.join(WAIT_S)
    finally:
        release.set()
        cache.close()


def test_an_interruption_never_lands_inside_starting_a_compile_process(tokenizer, monkeypatch):
    """A child process started at the moment its compile timed out was left unreaped."""
    psutil = pytest.importorskip("psutil")
    popen = index_process.subprocess.Popen

    class SlowPopen(popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            time.sleep(0.3)  # (forked, not yet returned: the timeout lands here)

    monkeypatch.setattr(index_process.subprocess, "Popen", SlowPopen)
    backend = OutlinesGrammarBackend(tokenizer, tokenizer.eos_token_id)
    others = {child.pid for child in psutil.Process().children()}
    cache = GrammarCache(backend, timeout_s=0.1)
    try:
        for i in range(3):
            with pytest.raises(ValueError, match="longer than"):
                cache.get("regex", f"[a-c]{{{i + 1}}}x")
        time.sleep(0.5)  # (the abandoned compiles end)
        assert not backend._indexes._busy
    finally:
        cache.close()
    ours = [c for c in psutil.Process().children() if c.pid not in others]
    assert not ours, [(c.pid, c.status()) for c in ours]


@pytest.mark.parametrize("locks_held", [False, True])
def test_a_forked_child_is_told_the_engine_does_not_run_there(engine, locks_held):
    """With the engine's locks held at the fork by another of the parent's threads (as the
    loop or a caller may hold them), the child's copies stay held: a call that took one
    hung (its encode, a flush of its cache), and so did its exit (the at-exit shutdown)."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:  # (another thread's: the forking thread could take an RLock again)
        with engine._lock, engine._tokenizer_lock:
            holding.set()
            release.wait(WAIT_S)

    holder = threading.Thread(target=hold)
    if locks_held:
        holder.start()
        assert holding.wait(WAIT_S)

    def report() -> list:
        outcomes = []
        for call in (
            lambda: engine.submit("x", {"max_new_tokens": 2}),
            lambda: asyncio.run(
                asyncio.wait_for(engine.async_generate("x", {"max_new_tokens": 2}), 5)
            ),
            lambda: engine.encode("x"),
            engine.flush_cache,
            lambda: engine.abort(12345) or 1 / 0,  # (a request of the parent's: ignored)
            lambda: engine.shutdown() or 1 / 0,  # (returns: ZeroDivisionError)
        ):
            try:
                call()
                outcomes.append("returned")
            except RuntimeError as error:
                outcomes.append("spawn" in str(error) and "RuntimeError")
            except TimeoutError:
                outcomes.append("waited")
            except ZeroDivisionError:
                outcomes.append("returned")
        return outcomes

    def released() -> None:
        if locks_held:
            release.set()
            holder.join()

    assert _in_forked_child(report, released) == repr(["RuntimeError"] * 4 + ["returned"] * 2)


@pytest.mark.skipif(torch.get_num_threads() == 1, reason="one thread: no OpenMP pool to lose")
def test_an_engine_made_in_a_forked_child_of_a_process_running_engines(engine, tiny_path):
    """GNU OpenMP's pool (torch's CPU build) does not survive a fork: such an engine waited
    forever in its first parallel op, a weight copy at load. It is refused, naming spawn,
    unless it runs on one thread, which works."""
    engine.generate("x", {"max_new_tokens": 1})  # (the parent's pool has run)

    def report() -> list:
        outcomes = []
        for threads in (None, 1):
            try:
                with Engine(tiny_path, max_total_tokens=256, num_threads=threads) as child:
                    outcomes.append(len(child.generate("x", {"max_new_tokens": 2})["text"]) >= 0)
            except RuntimeError as error:
                outcomes.append("spawn" in str(error) and "RuntimeError")
        return outcomes

    uses_gnu_openmp = "libgomp" in Path("/proc/self/maps").read_text()
    expected = ["RuntimeError" if uses_gnu_openmp else True, True]
    assert _in_forked_child(report) == repr(expected)


def _in_forked_child(
    report: Callable[[], list], after_fork: Callable[[], None] | None = None
) -> str:
    """`repr(report())` as a forked child found it (killed past WAIT_S: a hang reads
    empty); `after_fork` runs in the parent once the child is forked."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: report, then leave at once)
        try:
            os.write(write, repr(report()).encode())
        finally:
            os._exit(0)
    os.close(write)
    if after_fork is not None:
        after_fork()
    deadline = time.monotonic() + WAIT_S
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    with os.fdopen(read) as pipe:
        return pipe.read()
