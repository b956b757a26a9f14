"""An Engine nobody references is collected: its loop thread exits and its KV pool is freed.

The loop thread holds the engine only weakly while idle, so dropping the last reference (as
re-running a notebook cell that builds `lp.Engine(...)` does) must not leak a model, a KV
pool and a thread each time.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import pytest

from lmprog_runtime import Engine

OK = {"max_new_tokens": 3, "temperature": 0}
JOIN_S = 30.0  # bounds how long a thread that never exits takes to be reported


def _build(
    tiny_path: str, use: str, max_total_tokens: int = 1024
) -> tuple[weakref.ref, weakref.ref, threading.Thread]:
    """Build and use an engine; return weak references to it and its KV pool, and its loop
    thread. Built in a helper so that no frame of the test keeps a strong reference."""
    engine = Engine(tiny_path, max_total_tokens=max_total_tokens)
    if use in ("program", "default backend"):
        import lmprog as lp

        @lp.function
        def hello(s):
            s += "Hello," + lp.gen("a", max_tokens=3, temperature=0)

        if use == "program":
            assert hello.run(backend=engine)["a"] is not None
        else:
            import lmprog.backend

            saved = lmprog.backend._default_backend
            try:
                lp.set_default_backend(engine)
                assert hello.run()["a"] is not None
                lp.set_default_backend(Engine(tiny_path, max_total_tokens=256))  # a re-run
            finally:
                lmprog.backend._default_backend = saved
    elif use == "generate":
        assert len(engine.generate("hello", OK)["output_ids"]) == 3
    elif use == "stream":
        assert "".join(c["text"] for c in engine.generate("hello", OK, stream=True))
    assert engine._thread.is_alive()
    return weakref.ref(engine), weakref.ref(engine.runner.kv_pool), engine._thread


def _is_collected(refs: tuple[weakref.ref, ...], thread: threading.Thread) -> bool:
    gc.collect()
    thread.join(JOIN_S)
    return all(ref() is None for ref in refs) and not thread.is_alive()


@pytest.mark.parametrize("use", ["none", "generate", "stream", "program", "default backend"])
def test_an_unreferenced_engine_is_collected_and_its_thread_exits(tiny_path, use):
    """Also one a program ran on, or the default backend until another replaced it: the
    frontend's wrapper registry once held every such engine (and its loop thread) forever."""
    engine_ref, pool_ref, thread = _build(tiny_path, use)
    assert _is_collected((engine_ref, pool_ref), thread)


def _run_and_drop(tiny_path: str, how: str) -> tuple[weakref.ref, threading.Thread]:
    import lmprog as lp

    @lp.function
    def program(s):
        s += "Hello," + lp.gen("a", max_tokens=3, temperature=0)
        s += lp.select("b", choices=["yes", "no"])  # (a group of requests)
        if how == "fork":
            branches = s.fork(2)
            branches += lp.gen("c", max_tokens=2)
            branches.join()

    engine = Engine(tiny_path, max_total_tokens=1024)
    if how == "batch":
        assert all(st["b"] in ("yes", "no") for st in program.run_batch([{}, {}], backend=engine))
    else:
        state = program.run(backend=engine, stream=how == "stream")
        assert "".join(state.text_iter()) and state["b"] in ("yes", "no")
    return weakref.ref(engine), engine._thread


@pytest.mark.parametrize("how", ["run", "stream", "fork", "batch"])
def test_an_engine_a_program_ran_on_goes_without_a_garbage_collection(tiny_path, how):
    """A program's streams, requests and callbacks made reference cycles (a select's group
    and its requests, a countdown and its futures, a stream and its state's listener, a
    fork's branches and their parent), and the engine went only with the collector's next
    full pass: dropped engines of the instruct model held 560 MiB each until then."""
    gc.collect()
    gc.disable()
    try:
        engine_ref, thread = _run_and_drop(tiny_path, how)
        thread.join(JOIN_S)
        assert engine_ref() is None and not thread.is_alive()
    finally:
        gc.enable()


def _drop_at_join(tiny_path: str) -> tuple[weakref.ref, threading.Thread]:
    import lmprog as lp

    @lp.function
    def program(s):
        s += "Hi" + lp.gen("a", max_tokens=2, temperature=0)
        branches = s.fork(2)
        branches += lp.gen("c", max_tokens=40, temperature=0)
        branches.join()
        s += lp.gen("d", max_tokens=2, temperature=0)

    engine = Engine(tiny_path, max_total_tokens=2048)
    state = program.run(stream=True, backend=engine)
    state._body.join()  # (the body has returned; the branches still run)
    return weakref.ref(engine), engine._thread


def test_a_streaming_run_dropped_while_its_fork_runs_still_ends(tiny_path):
    """Branches held their parent weakly: a streaming run whose caller dropped its state
    while the branches ran lost its root, which never reached its join's end, and the
    interpreter thread, holding that round's streams, kept every later engine alive."""
    from lmprog.interpreter import INTERPRETER

    gc.collect()
    gc.disable()
    try:
        engine_ref, thread = _drop_at_join(tiny_path)
        thread.join(JOIN_S)
        deadline = time.monotonic() + JOIN_S
        while INTERPRETER._num_live and time.monotonic() < deadline:
            time.sleep(0.05)
        assert INTERPRETER._num_live == 0
        assert engine_ref() is None and not thread.is_alive()
    finally:
        gc.enable()


def test_the_interpreter_waiting_for_another_program_holds_no_engine(tiny_path):
    """While another program's body keeps the interpreter thread up, it waited holding the
    last stream it had run (its loop's variables), and so that stream's engine."""
    import lmprog as lp

    gate = threading.Event()

    @lp.function
    def blocked(s):
        s += "x"
        gate.wait(4 * JOIN_S)  # (past the join below: set in its `finally`)
        s += lp.gen("a", max_tokens=2)

    with Engine(tiny_path, max_total_tokens=1024) as other:
        state = blocked.run(stream=True, backend=other)
        try:
            engine_ref, thread = _run_and_drop(tiny_path, "fork")
            assert _is_collected((engine_ref,), thread)
        finally:
            gate.set()
            state.sync()


def test_recreating_engines_does_not_accumulate_threads(tiny_path):
    """The notebook case: a cell that rebuilds the engine, run again and again."""
    gc.collect()
    num_threads = threading.active_count()
    for _ in range(5):
        engine_ref, pool_ref, thread = _build(tiny_path, "generate")
        assert _is_collected((engine_ref, pool_ref), thread)
    assert threading.active_count() == num_threads


def test_a_shut_down_engine_leaves_no_grammar_compile_thread(tiny_path):
    """Constrained requests compile their grammars on threads of the engine's own; a
    shut-down engine (still referenced, as in a notebook) leaves none of them running."""
    before = set(threading.enumerate())  # (other engines' compile threads are not ours)
    engine = Engine(tiny_path, max_total_tokens=1024)
    out = engine.generate("hello", {"max_new_tokens": 4, "regex": "(yes|no)!"})
    assert out["text"] in ("yes!", "no!")
    started = set(threading.enumerate()) - before
    compilers = [t for t in started if t.name.startswith("lmprog-grammar")]
    assert compilers  # (what the test is about)
    engine.shutdown()
    for thread in compilers:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in compilers)
    # A constrained request after it is refused, and starts no compile thread again.
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate("hello", {"max_new_tokens": 4, "regex": "(maybe|never)!"})
    later = set(threading.enumerate()) - before
    assert not [t for t in later if t.name.startswith("lmprog-grammar") and t.is_alive()]


def _compile_and_drop(tiny_path: str) -> tuple[weakref.ref, weakref.ref, threading.Thread]:
    engine = Engine(tiny_path, max_total_tokens=1024)
    out = engine.generate("hello", {"max_new_tokens": 4, "regex": "(yes|no)!"})
    assert out["text"] in ("yes!", "no!")
    return weakref.ref(engine), weakref.ref(engine._grammars), engine._thread


def test_a_dropped_engine_that_compiled_leaves_no_compile_thread_or_process(tiny_path):
    """The compile threads held their pool's grammar cache (and so its compile processes)
    after their compile was over, and waited for work forever: each dropped engine left a
    thread, a process and its grammars behind."""
    psutil = pytest.importorskip("psutil")

    def compile_children() -> set[int]:
        return {
            c.pid
            for c in psutil.Process().children()
            if "index_child" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE
        }

    before, children = set(threading.enumerate()), compile_children()
    for _ in range(3):
        engine_ref, cache_ref, thread = _compile_and_drop(tiny_path)
        assert _is_collected((engine_ref, cache_ref), thread)
    deadline = time.monotonic() + JOIN_S
    while True:
        started = [t for t in set(threading.enumerate()) - before if t.is_alive()]
        if not started and compile_children() <= children or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not started and compile_children() <= children


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_twenty_engines_in_a_row_hold_memory_flat(tiny_path):
    """Each engine's KV pool is 64 MiB (131,072 tokens of the tiny model); twenty kept
    alive would add over a GiB."""
    pool_tokens = 131_072

    def cycle() -> int:
        engine_ref, pool_ref, thread = _build(tiny_path, "generate", pool_tokens)
        assert _is_collected((engine_ref, pool_ref), thread)
        return _rss_bytes()

    # The allocator may keep the last freed pool mapped or not, so single readings swing by
    # about one pool between cycles; compare the highs. A leaked pool per cycle adds 20.
    before = max(cycle() for _ in range(3))  # allocator caches and lazy imports settle first
    after = max(cycle() for _ in range(20))
    assert after - before < 64 * 2**20


def test_a_shut_down_engine_is_collected_too(tiny_path):
    engine = Engine(tiny_path, max_total_tokens=1024)
    engine.generate("hello", OK)
    engine.shutdown()
    engine.shutdown()  # idempotent
    refs, thread = (weakref.ref(engine),), engine._thread
    del engine
    assert not thread.is_alive()  # shutdown joined it
    assert _is_collected(refs, thread)


def test_a_referenced_idle_engine_keeps_serving(tiny_path):
    """Dropping the reference while waiting must not make the loop give up on a live engine."""
    with Engine(tiny_path, max_total_tokens=1024) as engine:
        for _ in range(3):
            gc.collect()
            assert len(engine.generate("hello", OK)["output_ids"]) == 3
        assert engine._thread.is_alive()


def _abandon_a_stream(tiny_path: str) -> tuple[weakref.ref, threading.Thread]:
    engine = Engine(tiny_path, max_total_tokens=1024)
    chunks = engine.generate("hello", {"max_new_tokens": 64, "ignore_eos": True}, stream=True)
    next(chunks)
    return weakref.ref(engine), engine._thread  # `chunks` (and its request) is dropped here


def test_an_engine_dropped_mid_request_is_collected_when_the_loop_lets_go(tiny_path):
    """The loop thread holds the engine while it steps, so it may drop the last reference."""
    engine_ref, thread = _abandon_a_stream(tiny_path)
    thread.join(JOIN_S)  # it finishes the abandoned request, then finds the engine gone
    assert _is_collected((engine_ref,), thread)


def _submit_and_drop(tiny_path: str) -> tuple[list, weakref.ref]:
    engine = Engine(tiny_path, max_total_tokens=1024)
    futures = engine.submit(["Hello", "World"], {"max_new_tokens": 200, "ignore_eos": True})
    return futures, weakref.ref(engine)


def test_an_engine_dropped_with_requests_pending_serves_them_then_is_collected(tiny_path):
    """The loop once let go of the engine between steps: collected mid-work, its futures
    never resolved (no error either)."""
    futures, engine_ref = _submit_and_drop(tiny_path)
    gc.collect()
    outs = [future.result(timeout=120) for future in futures]
    assert [len(out["output_ids"]) for out in outs] == [200, 200]
    deadline = time.monotonic() + JOIN_S
    while engine_ref() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert engine_ref() is None


def test_a_script_that_exits_while_its_engine_works_exits_cleanly(tiny_path, tmp_path):
    """The engine is shut down at exit: its loop thread, left running torch while Python
    finalized, once aborted the process (SIGABRT, "terminate called without an active
    exception"), as when a script breaks out of a stream and ends."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from lmprog_runtime import Engine\n"
        f"engine = Engine({tiny_path!r})\n"
        "stream = engine.generate('Hi', {'max_new_tokens': 1500, 'ignore_eos': True},"
        " stream=True)\n"
        "for i, chunk in enumerate(stream):\n"
        "    if i == 3:\n"
        "        break\n"
        "print('leaving')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "leaving"


def test_a_ctrl_c_during_shutdown_leaves_the_rest_to_the_next_call(tiny_path, _engine_registry):
    """A Ctrl-C while `shutdown()` waited for the loop's step made every later call (the
    at-exit one too) return at once: the loop ran on into the interpreter's exit (SIGABRT,
    "terminate called without an active exception") and its requests' slots stayed held.
    Now the next call waits for the loop and finishes the shutdown."""
    import signal

    engine = Engine(tiny_path, max_total_tokens=1024)
    in_step, leave_step = threading.Event(), threading.Event()
    run_once = engine._run_once

    def slow_step():  # (a long forward: the loop is inside a step when the Ctrl-C lands)
        in_step.set()
        leave_step.wait(JOIN_S)
        run_once()

    engine._run_once = slow_step
    future = engine.submit("hello", {"max_new_tokens": 50, "ignore_eos": True})[0]
    assert in_step.wait(JOIN_S)
    _engine_registry.reported.add(engine)  # not clean at its shutdown, by design

    # (a real SIGINT to the main thread, as Ctrl-C sends: it interrupts the wait)
    main = threading.main_thread().ident
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.shutdown()
    finally:
        timer.cancel()
    assert engine._thread.is_alive()  # still in its step
    leave_step.set()
    engine.shutdown()  # (returned at once: the loop ran on)
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="shut down before this request finished"):
        future.result(JOIN_S)
    state = engine.memory_state()
    assert state["req_slots_free"] == state["req_slots_total"], state


def test_shutdown_gives_back_the_torch_thread_count_num_threads_set(tiny_path):
    """`num_threads` sets torch's process-wide count; it stayed set after shutdown, for the
    rest of the process (the caller's own torch work and other engines included)."""
    import torch

    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    with Engine(tiny_path, max_total_tokens=256, num_threads=threads) as engine:
        assert torch.get_num_threads() == threads
        assert len(engine.generate("hello", OK)["output_ids"]) == 3
    assert torch.get_num_threads() == before
    with Engine(tiny_path, max_total_tokens=256, num_threads=threads):
        torch.set_num_threads(threads + 1)  # (changed since: left as it is)
    assert torch.get_num_threads() == threads + 1
    torch.set_num_threads(before)
